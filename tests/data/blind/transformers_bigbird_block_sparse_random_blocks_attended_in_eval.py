# huggingface/transformers PR #23056 (fixes #23055): BigBirdBlockSparseAttention kept sampling random key
# blocks in eval mode, so at inference each query block still attended to random far-away blocks; the fix returns
# an all-zero rand_attn (no random attention) from _bigbird_block_rand_mask(_with_head) when not self.training.
import sys
import numpy as np
import torch
from transformers import BigBirdConfig, BigBirdModel
from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention

FIXED = "--fixed" in sys.argv

if not FIXED:
    # before the fix the random adjacency list was built the same way in train and eval:
    # the "if not self.training: return rand_attn" early exit did not exist.
    _orig_rand = BigBirdBlockSparseAttention._bigbird_block_rand_mask
    _orig_rand_head = BigBirdBlockSparseAttention._bigbird_block_rand_mask_with_head

    def _bigbird_block_rand_mask(self, *args, **kwargs):
        was = self.training
        self.training = True
        try:
            return _orig_rand(self, *args, **kwargs)
        finally:
            self.training = was

    def _bigbird_block_rand_mask_with_head(self, *args, **kwargs):
        # before the fix bigbird_block_sparse_attention also called np.random.seed(self.seed) on every forward,
        # whatever the mode; at these sizes this helper is the only sampler, so seeding here is the same thing
        np.random.seed(self.seed)
        was = self.training
        self.training = True
        try:
            return _orig_rand_head(self, *args, **kwargs)
        finally:
            self.training = was

    BigBirdBlockSparseAttention._bigbird_block_rand_mask = _bigbird_block_rand_mask
    BigBirdBlockSparseAttention._bigbird_block_rand_mask_with_head = _bigbird_block_rand_mask_with_head

torch.manual_seed(0)
np.random.seed(0)
block = 2
cfg = BigBirdConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=64, attention_type="block_sparse",
                    block_size=block, num_random_blocks=2, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
model = BigBirdModel(cfg).eval()

L = 32
ids = torch.randint(5, 50, (1, L))
with torch.no_grad():
    ref = model(ids).last_hidden_state
# In eval the pattern is sliding window (3 blocks) + global first/last block. Query block 2 (tokens 4,5) sees blocks
# 1,2,3 and 0, last. Perturb every token in blocks 5..L/block-2, which only random attention can reach.
q_blk = 2
far = list(range(5 * block, (L // block - 1) * block))
ids2 = ids.clone()
ids2[0, far] = (ids2[0, far] + 7) % 45 + 5
with torch.no_grad():
    out = model(ids2).last_hidden_state
leak = (out[0, q_blk * block:(q_blk + 1) * block] - ref[0, q_blk * block:(q_blk + 1) * block]).abs().max().item()
print(f"eval: change of query block {q_blk} output when only out-of-window tokens change: {leak:.6f}")
