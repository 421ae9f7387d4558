"""Root config.json contents of the tiny checkpoints: the V4.1 architecture, every layer role present.

Layer plan of tiny-v41 (12 layers, 3 DSpark stages):
  0, 1      SWA only (Engram before layer 1)
  2, 4      ratio 2, FULL (own compressor + indexer; Engram before layer 4)
  3, 5      ratio 2, REUSE
  6         ratio 1, FULL + candidate source
  7, 9, 11  ratio 1, REUSE
  8, 10     ratio 1, REINDEX inside the candidate pool
The vocabulary keeps the real 129,280 ids so that special tokens sit at their official ids; rows of
ids the tiny tokenizer does not define are zero (see make_tiny.py).
``engram_num_embeddings`` and ``engram_compressed_vocab_size`` are filled in by make_tiny.py from the
prime layout and the tokenizer.
"""

TINY_V41_TEXT = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 12,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_cache": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 256},
    "compress_rope_theta": 160000,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 8,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 8, 10],
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 4,
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 2,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 4],
    "engram_num_embeddings": None,  # filled in
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 1000,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": None,  # filled in
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [9, 10, 11],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}

TINY_V41_ROOT = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "transformers_version": "5.6.0",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "text_config": TINY_V41_TEXT,
}

# --------------------------------------------------------------------------------------------------
# Tiny DeepSeek-V4-Flash (model_type deepseek_v4): the official root layout of spec §1.2, shrunk. Used by
# tests/test_v4flash*.py and the transformers parity test (random weights made in the test; no checkpoint
# is committed). Layer plan, mirroring the real [0,0] + [4,128]*20 + [4] + [0]:
#   0, 1   SWA only                        (hash-routed MoE: num_hash_layers = 3)
#   2, 4, 6  ratio 4: overlapping compressor + Hadamard-rotated indexer (layer 2 hash-routed)
#   3, 5   ratio 128: non-overlapping compressor, attends every visible entry
#   entry 7 = the MTP layer (ratio 0)
# sliding_window 16 and index_topk 4 are small so that the window evicts and the indexer really selects
# within a ~150-token test prompt; ratio 128 stays real, so prompts of >= 128 tokens reach HCA entries.
TINY_V4FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "transformers_version": "4.57.1",
    "torch_dtype": "bfloat16",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 7,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 16,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_nextn_predict_layers": 1,
    "sliding_window": 16,
    "index_n_heads": 16,  # many heads: a score of exactly 0 (every head ReLU-clipped) would tie
    "index_head_dim": 32,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0],
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
}
