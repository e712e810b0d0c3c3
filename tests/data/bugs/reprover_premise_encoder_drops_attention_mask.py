# lean-dojo/ReProver#34: the premise-retriever `encode` (README usage) calls the ByT5 encoder with input_ids only,
# so a premise padded in a batch attends to the pad bytes and its embedding depends on its batch neighbours.
import sys
from typing import List, Union

import torch
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ByteTokenizer:
    """ByT5-style tokenizer: bytes + 3, pad=0, eos=1, padding=True pads on the right."""

    pad_token_id = 0

    def __call__(self, s: List[str], return_tensors="pt", padding=True):
        ids = [[b + 3 for b in x.encode("utf-8")] + [1] for x in s]
        n = max(len(i) for i in ids)
        input_ids = torch.tensor([i + [0] * (n - len(i)) for i in ids])
        attention_mask = torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i in ids])
        return type("BatchEncoding", (), {"input_ids": input_ids, "attention_mask": attention_mask})


tokenizer = ByteTokenizer()
config = T5Config(vocab_size=259, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu")
model = T5EncoderModel(config).eval()

state = "n : N |- gcd n n = n"
premises = [
    "def nat.gcd : nat -> nat -> nat",
    "theorem nat.gcd_zero_left (x : nat) : gcd 0 x = x",
    "theorem nat.mod_self (n : nat) : n % n = 0",
    "lemma vsub_eq_zero_iff_eq {p1 p2 : P} : p1 -v p2 = (0 : G) <-> p1 = p2",
]


@torch.no_grad()
def encode(s: Union[str, List[str]]) -> torch.Tensor:
    """Encode texts into feature vectors."""
    if isinstance(s, str):
        s = [s]
        should_squeeze = True
    else:
        should_squeeze = False
    tokenized_s = tokenizer(s, return_tensors="pt", padding=True)
    if FIXED:
        hidden_state = model(tokenized_s.input_ids, attention_mask=tokenized_s.attention_mask).last_hidden_state
    else:
        hidden_state = model(tokenized_s.input_ids).last_hidden_state
    lens = tokenized_s.attention_mask.sum(dim=1)
    features = (hidden_state * tokenized_s.attention_mask.unsqueeze(2)).sum(dim=1) / lens.unsqueeze(1)
    if should_squeeze:
        features = features.squeeze()
    return features


@torch.no_grad()
def retrieve(state: str, premises: List[str], k: int):
    """Retrieve the top-k premises given a state."""
    state_emb = encode(state)
    premise_embs = encode(premises)
    scores = state_emb @ premise_embs.T
    return scores, scores.topk(k).indices.tolist()


scores, topk = retrieve(state, premises, k=2)
batched = encode(premises)
alone = torch.stack([encode(p) for p in premises])
print("fixed" if FIXED else "buggy", "scores", [round(v, 4) for v in scores.tolist()], "top-2", topk)
print("max |premise embedding in batch - alone| =", (batched - alone).abs().max().item())
