"""A correct attention function registered with transformers' AttentionInterface that attends in tiles, as a
flash kernel (or a ring's steps) does: queries and keys each split in two halves, three tiles (first queries over
first keys, causal; last queries over first keys, all of them earlier, so unmasked; last queries over last keys,
causal), each a softmax over part of the queries or keys HF handed the function, merged by their log-sum-exps. A
tiny LlamaForCausalLM built from its config, its mask interface flash's (no mask made for an unpadded batch, so the
function reads the module's is_causal), one forward over a batch of two. The program checks its logits against the
same model on transformers' own sdpa. The unmasked tile alone does not say where its queries sit: it is no block
that sees later keys."""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

torch.manual_seed(0)


def tile(q, k, v, scale, causal):
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1, keepdim=True)


def blockwise_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    assert attention_mask is None and module.is_causal
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    half = query.shape[2] // 2
    q0, q1, k0, k1, v0, v1 = query[:, :, :half], query[:, :, half:], key[:, :, :half], key[:, :, half:], \
        value[:, :, :half], value[:, :, half:]
    first, _ = tile(q0, k0, v0, scaling, True)
    early, lse_early = tile(q1, k0, v0, scaling, False)
    late, lse_late = tile(q1, k1, v1, scaling, True)
    lse = torch.logaddexp(lse_early, lse_late)
    second = early * torch.exp(lse_early - lse) + late * torch.exp(lse_late - lse)
    return torch.cat([first, second], dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register("blockwise", blockwise_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("blockwise", flash_attention_mask)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
model = LlamaForCausalLM(config).eval()
ids = torch.tensor([[5, 9, 12, 7, 3, 8, 11, 4], [6, 10, 2, 13, 1, 14, 15, 9]])
mask = torch.ones_like(ids)
with torch.no_grad():
    model.config._attn_implementation = "blockwise"
    mine = model(input_ids=ids, attention_mask=mask).logits
    model.config._attn_implementation = "sdpa"
    reference = model(input_ids=ids, attention_mask=mask).logits
real = mask.bool()
assert torch.allclose(mine[real], reference[real], atol=1e-5), (mine[real] - reference[real]).abs().max()
print("tiled logits match sdpa on the real tokens:", float((mine[real] - reference[real]).abs().max()))
