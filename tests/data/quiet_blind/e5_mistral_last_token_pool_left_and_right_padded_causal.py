"""E5-Mistral / SFR-Embedding style text embeddings: a causal decoder, last-token pooling over left padding.

Follows intfloat/e5-mistral-7b-instruct (model card and the e5 repo's utils), function last_token_pool:
      left_padding = (attention_mask[:, -1].sum() == attention_mask.shape[0])
      if left_padding:
          return last_hidden_states[:, -1]
      else:
          sequence_lengths = attention_mask.sum(dim=1) - 1
          return last_hidden_states[torch.arange(batch_size), sequence_lengths]
  queries are 'Instruct: {task}\nQuery: {q}', each ends with eos appended by the tokenizer, the batch is
  padded by the tokenizer (the Mistral tokenizer pads on the left) and the model is run causally with that
  attention_mask: outputs = model(**batch_dict); embeddings are L2-normalised.
The model stays causal: the last real token is the one that has seen the whole text.
Reduced: MistralModel built from a tiny MistralConfig (no weights), float64, token ids drawn at random.
Check: the embeddings of a left-padded batch and of a right-padded batch both equal each text run alone
(right padded: exactly; left padded: to RoPE's float32 rounding, since positions shift by the padding).
"""
import torch
import torch.nn.functional as F
from transformers import MistralConfig, MistralModel

torch.manual_seed(0)

PAD, EOS = 0, 2
config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=PAD, eos_token_id=EOS, sliding_window=None)
config._attn_implementation = "sdpa"
model = MistralModel(config).double().eval()


def last_token_pool(last_hidden_states, attention_mask):
    left_padding = (attention_mask[:, -1].sum() == attention_mask.shape[0])
    if left_padding:
        return last_hidden_states[:, -1]
    else:
        sequence_lengths = attention_mask.sum(dim=1) - 1
        batch_size = last_hidden_states.shape[0]
        return last_hidden_states[torch.arange(batch_size, device=last_hidden_states.device), sequence_lengths]


texts = [torch.cat([torch.randint(3, 64, (n,)), torch.tensor([EOS])]) for n in (9, 4, 6, 2)]
T = max(len(t) for t in texts)


def pad(side):
    ids = torch.full((len(texts), T), PAD)
    mask = torch.zeros(len(texts), T, dtype=torch.long)
    for i, t in enumerate(texts):
        if side == "left":
            ids[i, T - len(t):], mask[i, T - len(t):] = t, 1
        else:
            ids[i, :len(t)], mask[i, :len(t)] = t, 1
    return {"input_ids": ids, "attention_mask": mask}


with torch.no_grad():
    alone = torch.cat([
        F.normalize(model(input_ids=t[None]).last_hidden_state[:, -1], p=2, dim=1) for t in texts])
    worst = {}
    for side in ("left", "right"):
        batch_dict = pad(side)
        outputs = model(**batch_dict)
        embeddings = last_token_pool(outputs.last_hidden_state, batch_dict["attention_mask"])
        embeddings = F.normalize(embeddings, p=2, dim=1)
        worst[side] = (embeddings - alone).abs().max().item()
        scores = embeddings[:2] @ embeddings[2:].T  # queries x passages, as the model card does
        assert torch.allclose(scores, alone[:2] @ alone[2:].T, atol=1e-10)
print(f"max |batched embedding - alone|: left padded {worst['left']:.3e}, right padded {worst['right']:.3e}")
# left padding shifts the absolute positions (no position_ids are passed, as in e5); RoPE's cos/sin are
# computed in float32 by transformers, so shifted positions differ by float32 rounding only (~1e-10 here)
assert worst["right"] < 1e-12 and worst["left"] < 1e-8
