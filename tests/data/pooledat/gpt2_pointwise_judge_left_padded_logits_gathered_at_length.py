# The same bug as ms-swift#5751 (a reranker's yes/no logits read at a pad position) from the other side: a pointwise
# LLM judge whose tokenizer pads on the left (a decoder-only model's generation setting) gathers each row's logits at
# `attention_mask.sum(-1) - 1`, the last token of a right-padded row, so every shorter row is scored at a pad (or an
# earlier token). The fix reads the last column, each left-padded row's last real token.
import sys

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

words = ["<pad>", "<|endoftext|>", "yes", "no", "Query:", "Passage:", "Relevant:"] + [f"w{i}" for i in range(40)]
tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
tok.pre_tokenizer = Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|endoftext|>",
                                    padding_side="left")
YES, NO = tokenizer.convert_tokens_to_ids(["yes", "no"])

config = GPT2Config(vocab_size=len(words), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                    pad_token_id=tokenizer.pad_token_id)
model = GPT2LMHeadModel(config).eval()


class PointwiseJudge:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def score(self, query, passages):
        texts = [f"Query: {query} Passage: {p} Relevant:" for p in passages]
        enc = self.tokenizer(texts, padding=True, return_tensors="pt")
        position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = self.model(**enc, position_ids=position_ids).logits  # (B, L, V)
        if FIXED:
            last = logits[:, -1, :]  # left padding: every row ends in the last column
        else:
            lengths = enc["attention_mask"].sum(-1) - 1
            index = lengths[:, None, None].expand(-1, 1, logits.size(-1))
            last = torch.gather(logits, 1, index).squeeze(1)
        return torch.softmax(last[:, [NO, YES]], dim=-1)[:, 1]


judge = PointwiseJudge(model, tokenizer)
query = "w1 w2 w3"
passages = ["w4 w5 w6 w7 w8 w9 w10 w11 w18 w19 w20 w21 w22 w23", "w12", "w14 w15 w16 w17"]
batched = judge.score(query, passages)
alone = torch.cat([judge.score(query, [p]) for p in passages])
print("relevance batched:", [round(v, 4) for v in batched.tolist()])
print("relevance alone:  ", [round(v, 4) for v in alone.tolist()])
print(f"max |batched - alone|: {(batched - alone).abs().max().item():.6f}")
