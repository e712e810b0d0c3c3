# A "receptive-field" check as long-context eval scripts write it (lm-evaluation-harness style rolling scores, rewritten
# for a sliding-window model): Qwen2 with use_sliding_window=True, sliding_window=3 on every layer (max_window_layers=0),
# 3 layers, so the last token's logits depend only on the 3 * (3 - 1) = 6 tokens before it. A batch of 2 rows is scored
# whole once; then each row's last 7 tokens are run again with use_cache=False and their true position_ids, and the
# last logit must equal the whole pass's (sdpa, then eager). No cache exists in the second pass: its keys are its own
# 7 tokens, and the query at the suffix's first position sees only itself there, as the program means.
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(3)
cfg = Qwen2Config(vocab_size=89, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, use_sliding_window=True, sliding_window=3, max_window_layers=0,
                  max_position_embeddings=64)
model = Qwen2ForCausalLM(cfg).double().eval()

ids = torch.randint(1, 89, (2, 15))
reach = cfg.num_hidden_layers * (cfg.sliding_window - 1)  # tokens back the last logit can depend on
worst = 0.0
for impl in ("sdpa", "eager"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        whole = model(ids).logits[:, -1]
        start = ids.shape[1] - 1 - reach
        tail = ids[:, start:]
        positions = torch.arange(start, ids.shape[1]).expand(2, -1)
        last = model(tail, position_ids=positions, use_cache=False).logits[:, -1]
        short = model(tail[:, 1:], position_ids=positions[:, 1:], use_cache=False).logits[:, -1]  # one token too few
    d = (whole - last).abs().max().item()
    assert d == d
    worst = max(worst, d)
    assert (whole - short).abs().max().item() > 1e-4  # the reach is exact: the token 6 back still counts
print(f"max |whole - suffix at its positions| = {worst:.3e}")
assert worst < 1e-6  # (eager's softmax runs in float32)
