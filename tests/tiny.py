"""The tiny training run the end-to-end tests share: a 2-layer, 64-wide model on 4 x 64 tokens, in fp32,
uncompiled, logging every step (fast and the same on any CPU)."""
TINY_MODEL = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--n_kv_head=1", "--sequence_len=64", "--batch_size=4",
              "--compile=false", "--dtype=float32", "--log_every=1"]
# step-counted runs: small evaluations, no sample, no time budget
TINY_RUN = TINY_MODEL + ["--eval_tokens=2048", "--sample_tokens=0", "--time_budget_s=0"]
