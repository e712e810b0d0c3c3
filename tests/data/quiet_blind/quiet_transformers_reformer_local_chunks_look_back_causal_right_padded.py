# Correct program (quiet batch quiet-r71b).
# Citation: huggingface/transformers @20926db3b9b0aa8c67bb624d014a358b7e86984e
#   src/transformers/models/reformer/modeling_reformer.py (LocalSelfAttention.forward / _compute_attn_mask,
#   EfficientAttentionMixin._look_adjacent, ReformerModel.forward -> _pad_to_mult_of_chunk_length).
# Masking: Reformer's chunked local attention. The sequence is cut into chunks of local_attn_chunk_length = 4, each
#   chunk's keys are its own chunk plus local_num_chunks_before = 1 chunk before (_look_adjacent, which rolls the
#   first chunk onto the last one), and the causal mask compares the chunked query / key indices (so the rolled
#   keys and the future fall away); the right-padded batch's attention_mask is chunked and looked-adjacent the same
#   way. ReformerModel pads the length 14 batch to 16 (a multiple of the chunk) with attention_mask 0.
# Self-check: (1) each local layer's output against a dense masked reference (double loop over real queries: keys j
#   with j <= i, j // 4 >= i // 4 - 1 and j real); (2) logits of every real token against each sequence run alone,
#   unpadded, with no attention_mask; (3) the LM loss against a hand double loop over the real next tokens.
import numpy as np
import torch
from transformers import ReformerConfig, ReformerModelWithLMHead

torch.manual_seed(0)
config = ReformerConfig(
    vocab_size=40, hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=48,
    attn_layers=["local", "local"], local_attn_chunk_length=4, local_num_chunks_before=1,
    local_num_chunks_after=0, is_decoder=True, axial_pos_embds=False, max_position_embeddings=32,
    hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=2,
    chunk_size_lm_head=0, chunk_size_feed_forward=0,
)
model = ReformerModelWithLMHead(config).eval()

lengths = [14, 9, 5]
L = max(lengths)
seqs = [torch.randint(3, config.vocab_size, (n,)) for n in lengths]
input_ids = torch.full((len(seqs), L), config.pad_token_id)
attention_mask = torch.zeros(len(seqs), L, dtype=torch.long)
for b, s in enumerate(seqs):                       # right padding
    input_ids[b, : len(s)] = s
    attention_mask[b, : len(s)] = 1
labels = input_ids.masked_fill(attention_mask == 0, -100)

seen = []


def hook(module, args, kwargs, output):
    seen.append((module, kwargs["hidden_states"].detach(), kwargs["attention_mask"], output.hidden_states.detach()))


for layer in model.reformer.encoder.layers:
    layer.attention.self_attention.register_forward_hook(hook, with_kwargs=True)

with torch.no_grad():
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

# (1) dense masked reference for each local attention layer
assert len(seen) == 2
C = config.local_attn_chunk_length
nh, hd = config.num_attention_heads, config.attention_head_size
for module, hs, am, got in seen:
    B, T, _ = hs.shape
    assert T == 16 and am.shape == (B, T)
    q = module.query(hs).view(B, T, nh, hd)
    k = module.key(hs).view(B, T, nh, hd) / np.sqrt(hd)
    v = module.value(hs).view(B, T, nh, hd)
    got = got.view(B, T, nh, hd)
    for b in range(B):
        n = lengths[b]
        for h in range(nh):
            for i in range(n):
                keys = [j for j in range(n) if j <= i and j // C >= i // C - 1]
                s = torch.stack([q[b, i, h] @ k[b, j, h] for j in keys])
                ref = (s.softmax(-1)[:, None] * v[b, keys, h]).sum(0)
                assert torch.allclose(got[b, i, h], ref, atol=1e-5), (b, h, i)

# (2) each sequence alone, unpadded, no mask
for b, s in enumerate(seqs):
    with torch.no_grad():
        alone = model(input_ids=s[None]).logits[0]
    assert torch.allclose(out.logits[b, : len(s)], alone, atol=1e-4), b

# (3) the LM loss by a double loop over real next tokens
logp = out.logits.log_softmax(-1)
terms = [-logp[b, t, seqs[b][t + 1]] for b in range(len(seqs)) for t in range(lengths[b] - 1)]
assert torch.allclose(out.loss, torch.stack(terms).mean(), atol=1e-5)
print("ok")
