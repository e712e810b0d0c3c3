# Citation: huggingface/transformers src/transformers/models/olmo3/modeling_olmo3.py
#   @a0699c971daff96403489086fcfd07469d20b17f (Olmo3Model.forward: causal_mask_mapping from create_causal_mask /
#   create_sliding_window_causal_mask with position_ids, each layer takes the mask of its layer_types entry,
#   sliding_window=3, "sliding_attention" x3 + "full_attention" from configuration_olmo3.py) fed by
#   src/transformers/data/data_collator.py DataCollatorWithFlattening (padding-free packing: one row, position_ids
#   restarting at 0 for each example, the first label of each example -100, no attention_mask).
# Masking: with attention_mask None and no cache the mask builder reads the packed layout from the restarting
#   position_ids, so each token sees only its own example: the last 3 tokens of it in the sliding layers, its whole
#   causal prefix in the full layer.
# Self-check: every packed example's logits equal that example run alone (batch of one, no mask), the packed loss
#   equals the token-weighted mean of the per-example losses, and one padded batch (right padding, attention_mask)
#   gives the same logits on real tokens.
import torch
from transformers import DataCollatorWithFlattening, Olmo3Config, Olmo3ForCausalLM

torch.manual_seed(0)
config = Olmo3Config(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, sliding_window=3, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2)
config._attn_implementation = "sdpa"
assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"], config.layer_types
model = Olmo3ForCausalLM(config)
model.train()  # dropout is 0 in the config

features = [{"input_ids": torch.randint(3, 80, (n,)).tolist()} for n in (7, 5, 9)]
for f in features:
    f["labels"] = list(f["input_ids"])
collator = DataCollatorWithFlattening(return_position_ids=True)
batch = collator(features)
assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
out = model(**batch, use_cache=False)
out.loss.backward()

starts = [0]
for f in features:
    starts.append(starts[-1] + len(f["input_ids"]))

with torch.no_grad():
    loss_sum, n_tok = 0.0, 0
    for i, f in enumerate(features):
        ids = torch.tensor([f["input_ids"]])
        alone = model(input_ids=ids, labels=ids, use_cache=False)
        got = out.logits[0, starts[i]:starts[i + 1]]
        assert torch.allclose(got, alone.logits[0], atol=1e-5), (i, (got - alone.logits[0]).abs().max())
        loss_sum += alone.loss.item() * (ids.shape[1] - 1)
        n_tok += ids.shape[1] - 1
    assert abs(out.loss.item() - loss_sum / n_tok) < 1e-5, (out.loss.item(), loss_sum / n_tok)

    # the same examples as a right-padded batch with an attention_mask
    L = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), L, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        am[i, :len(f["input_ids"])] = 1
    padded = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        assert torch.allclose(padded[i, :n], out.logits[0, starts[i]:starts[i + 1]], atol=1e-5), i
print(f"ok: olmo3 sliding/full packed loss {out.loss.item():.4f} matches per-example runs and the padded batch")
