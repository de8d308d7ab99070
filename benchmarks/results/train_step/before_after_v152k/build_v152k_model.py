"""The tiny benchmark Llama of bench_train_step (hidden 128, 2 layers, 4 heads, K&K BPE tokenizer, final norm x 3.5)
but with a 151,936-row (tied) embedding / lm_head, Qwen2.5's vocab_size. bench_train_step's own --vocab-size only
sets the BPE tokenizer's size, and its K&K corpus yields at most 748 ids (when these runs were made, a larger
--vocab-size silently gave 748; it is refused since), so the vocabulary had to be padded here. The added rows (ids >= len(tokenizer)) are zero (logit 0 for every hidden state, like
never-trained padding rows) and the final norm is scaled by 3.5 x MULT (default 1.6) instead of 3.5, so that both
Lopti phases hold tokens. How MULT was picked (bench_train_step runs of the lopti trainer at the sizes below, the
"low tokens" column, i.e. the share of response tokens with p < eta = 0.5): random added rows at 3.5 gave 1.00 (phase
2 empty); zero rows at x 2.5 and x 1.9 gave 0.00 (phase 1 empty); x 1.5: 0.77, 0.29; x 1.7: 0.36, 0.02; x 1.6 with
--lr 1e-5: 0.66, 0.53, 0.28 (successive steps). The low tokens are mostly the added ids (the real tokens are near
deterministic at this scale). The matmuls, which are what is timed, cost the same whatever the rows hold.

usage: python build_v152k_model.py OUT [VOCAB [MULT]]
"""
import sys

import torch

from openrlhf_lopti.demo.tiny_model import build_kk_tokenizer, build_tiny_llama

out = sys.argv[1]
vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 151936
tokenizer = build_kk_tokenizer(seed=0)  # all 748 ids (was written build_kk_tokenizer(1024, 0): the same tokenizer)
model = build_tiny_llama(tokenizer, 128, 2, 4, 2048, 0)  # the benchmark's sizes and seed
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(0)
    model.resize_token_embeddings(vocab, mean_resizing=False)
n_real = len(tokenizer)
with torch.no_grad():
    model.model.embed_tokens.weight[n_real:] = 0  # tied: the lm_head rows too
    mult = float(sys.argv[3]) if len(sys.argv) > 3 else 1.6
    model.model.norm.weight.mul_(3.5 * mult)  # bench_train_step's --sharpen default (3.5) x MULT
model.save_pretrained(out)
tokenizer.save_pretrained(out)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, lm_head {tuple(model.lm_head.weight.shape)},"
      f" tied {model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()}, tokenizer {len(tokenizer)}")
