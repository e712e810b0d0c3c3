# jakespringer/echo-embeddings (echo_embeddings.py: EchoParser builds embed_mask, EchoPooling strategy="mean"):
# a causal LM reads "<instr> text <rewrite> text"; only the second copy's tokens (embed_mask) are pooled, so they have
# already "seen" the whole text; padding (right) and the first copy are excluded from the mean but still attended.
import warnings; warnings.filterwarnings('ignore')
import torch
from transformers import MistralConfig, MistralModel
torch.manual_seed(0)
PAD = 0
cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, sliding_window=None, pad_token_id=PAD)
cfg._attn_implementation = "sdpa"
model = MistralModel(cfg).double().eval()
instr, rewrite = [1, 40, 41], [42, 43]
texts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]

def parse(t):
    ids = instr + t + rewrite + t
    embed = [0] * (len(instr) + len(t) + len(rewrite)) + [1] * len(t)
    return ids, embed

with torch.no_grad():
    parsed = [parse(t) for t in texts]
    L = max(len(p[0]) for p in parsed)
    ids = torch.full((3, L), PAD); am = torch.zeros_like(ids); em = torch.zeros_like(ids)
    for i, (p, e) in enumerate(parsed):
        ids[i, :len(p)] = torch.tensor(p); am[i, :len(p)] = 1; em[i, :len(e)] = torch.tensor(e)
    hs = model(input_ids=ids, attention_mask=am).last_hidden_state
    emb = (hs * em[..., None]).sum(1) / em.sum(1, keepdim=True)
    ref = torch.stack([model(input_ids=torch.tensor([p])).last_hidden_state[0, -len(t):].mean(0)
                       for (p, _), t in zip(parsed, texts)])
    diff = (emb - ref).abs().max().item()
    print("max diff echo second-copy mean pool, right-padded batch vs each alone:", diff)
    assert diff < 1e-10
