# transformers LlamaModel (models/llama/modeling_llama.py + masking_utils.py, create_causal_mask): packed SFT row
# given a custom 4D float bias (0 = keep, finfo.min = masked), block-diagonal-causal per document, used as-is by
# create_causal_mask, with position_ids restarting at 0 per doc so RoPE matches each doc run alone.
import warnings; warnings.filterwarnings('ignore')
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
cfg._attn_implementation = "sdpa"
model = LlamaForCausalLM(cfg).double().eval()
docs = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16]]

with torch.no_grad():
    ids = torch.tensor([sum(docs, [])])
    pos = torch.tensor([sum([list(range(len(d))) for d in docs], [])])
    seq_id = torch.tensor(sum([[i] * len(d) for i, d in enumerate(docs)], []))
    T = ids.shape[1]
    keep = (seq_id[:, None] == seq_id[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    bias = torch.zeros(1, 1, T, T, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    out_a = model(input_ids=ids, attention_mask=bias, position_ids=pos).logits[0]
    ref = torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in docs])
    da = (out_a - ref).abs().max().item()
    print("max diff packed (4D float bias) vs each doc alone:", da)
    assert da < 1e-10
