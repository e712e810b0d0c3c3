# Packed SFT rows as torchtune's packed_block_causal_mask builds them from per-row seq_lens (a block-causal bool mask,
# True = attend), handed to a Hugging Face model as a (B, 1, T, T) 4-D mask with position_ids restarting per document.
# Each row ends in a pad block (its seq_lens' last entry) whose position_ids count on 0, 1, .. like a document's, but
# the collator hides the pad block entirely: its tokens see no key and no token sees them; their logits are dropped.
# Two rows, SDPA, float32; every document must equal the same document run alone.
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(5)
cfg = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
model = Qwen2ForCausalLM(cfg).float().eval()
model.set_attn_implementation("sdpa")

T = 16
seq_lens = [[6, 4, 3], [9, 5]]  # documents per row; the rest of each row is its pad block
pads = [T - sum(lens) for lens in seq_lens]
docs = [[torch.randint(1, 61, (n,)) for n in lens] for lens in seq_lens]
ids = torch.stack([torch.cat(row + [torch.zeros(p, dtype=torch.long)]) for row, p in zip(docs, pads)])
position_ids = torch.stack([torch.cat([torch.arange(n) for n in lens] + [torch.arange(p)]) for lens, p in zip(seq_lens, pads)])


def block_causal(lens: list[int], pad: int) -> torch.Tensor:
    blocks = [torch.tril(torch.ones(n, n, dtype=torch.bool)) for n in lens] + [torch.zeros(pad, pad, dtype=torch.bool)]
    return torch.block_diag(*blocks)


mask = torch.stack([block_causal(lens, p) for lens, p in zip(seq_lens, pads)])[:, None]  # (B, 1, T, T)
worst = 0.0
with torch.no_grad():
    packed = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    for b, row in enumerate(docs):
        off = 0
        for doc in row:
            alone = model(input_ids=doc[None]).logits[0]
            d = (packed[b, off:off + len(doc)] - alone).abs().max().item()
            assert d == d, "NaN"
            worst = max(worst, d)
            off += len(doc)
print(f"max |packed - alone| = {worst:.3e}")
assert worst < 1e-5
