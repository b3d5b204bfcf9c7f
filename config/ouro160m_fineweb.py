# The paper's Ouro-160M pre-training run (App. B), for 8 GPUs:
#   torchrun --standalone --nproc_per_node=8 train.py config/ouro160m_fineweb.py
# Data: python prepare_data.py --dataset=fineweb_edu --tokens=20000000000 (GPT-2 BPE here; the paper
# used the Ouro-1.4B-thinking tokenizer, vocab 49,152, so the embedding sizes differ).
dataset = "fineweb_edu"
out_dir = "out-ouro160m"
# architecture: L=12, d=768, FFN 2048, 12/12 heads (head_dim 64), U=4, no per-loop norm, in-branch gain 0.02
n_layer = 12
n_embd = 768
ffn_hidden = 2048
n_head = 12
n_kv_head = 12
n_loops = 4
rope_theta = 1e6
loop_norm = False
branch_norm_init = 0.02
# 2048-token windows, 524,288 tokens per optimizer step = 16 sequences x 2048 x 16 micro-batches
block_size = 2048
batch_size = 16
gradient_accumulation_steps = 16   # split over the processes; must divide by their number
max_iters = 38147                  # 20B tokens
learning_rate = 2.5e-4
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
warmup_iters = 200                 # 104.86M tokens
lr_decay_start = 1907              # cosine decay starts at 1B tokens ...
lr_decay_iters = 38147
min_lr = 2.5e-5                    # ... to 10% of the peak
# objective: global prior enforcement with the App. B beta schedule (the default when beta is unset)
prior = "poisson"
global_kl = True
eval_interval = 1000
eval_iters = 39                    # ~5M validation tokens, as the paper's plots
log_interval = 10
dtype = "auto"                     # bf16 autocast on CUDA, parameters and AdamW states in fp32
