# Correct programs loop-sees-later must stay quiet on: (1) transformers' generate with use_cache=False on a tiny Llama
# over a left-padded batch (the whole sequence re-run each step, causal); (2) a hand-written greedy loop re-running a
# PaliGemma-style prefix LM, its prompt bidirectional among itself and each appended token causal; (3) a BERT masked
# LM filling a [MASK] appended each step (both ways, as a masked LM is: its ids change where the mask was filled).
import torch
import torch.nn as nn
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).eval()
ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
with torch.no_grad():
    out = llama.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=4, do_sample=False, use_cache=False,
                         pad_token_id=0)
print("llama:", out.tolist())


class PrefixLanguageModel(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4):
        super().__init__()
        self.embed, self.heads = nn.Embedding(vocab, dim), heads
        self.qkv, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)

    def forward(self, input_ids, prefix_len):
        b, n = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        at = torch.arange(n)
        keep = (at[None, :] <= at[:, None]) | (at[None, :] < prefix_len)  # the prompt both ways, the rest causal
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.head(x + a.transpose(1, 2).reshape(b, n, -1))


model = PrefixLanguageModel().eval()
seq = torch.tensor([[3, 4, 5, 6]])
with torch.no_grad():
    for _ in range(4):
        seq = torch.cat([seq, model(seq, 4)[:, -1].argmax(-1, keepdim=True)], dim=1)
print("prefix LM:", seq.tolist())

bert = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64)).eval()
MASK = 4
text = torch.tensor([[2, 10, 11]])
with torch.no_grad():
    for _ in range(3):
        text = torch.cat([text, torch.tensor([[MASK]])], dim=1)
        text[0, -1] = bert(input_ids=text).logits[0, -1].argmax()
print("bert:", text.tolist())
