"""An SFT batch whose tokenizer pads with its EOS id: each text ends with one EOS the mask keeps, then EOS padding.

A common setup (`tokenizer.pad_token = tokenizer.eos_token`): the collator appends the EOS to every text, truncates
to a maximum length (the longest text loses its EOS), pads the batch on the right with the same id, and builds the
attention_mask from each row's length, so the EOS that ends a text is a token (mask 1) and the copies after it are
padding (mask 0). The model is transformers' GPT-2 built from its
config. Self-check: each row's real positions match the row run alone, unpadded (quiet).
"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
EOS = 0
model = GPT2LMHeadModel(GPT2Config(vocab_size=30, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=EOS,
                                   eos_token_id=EOS, pad_token_id=EOS)).eval()
texts = [[5, 6, 7, 8, 9, 10, 18, 19], [11, 12, 13], [14, 15, 16, 17]]
MAX = 7  # (the collator truncates to 7 tokens: the longest text loses its tail and its EOS)
rows = [(t + [EOS])[:MAX] for t in texts]
width = max(len(r) for r in rows)
input_ids = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])
attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
with torch.no_grad():
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    for b, r in enumerate(rows):
        alone = model(input_ids=torch.tensor([r])).logits[0]
        assert torch.allclose(logits[b, :len(r)], alone, atol=1e-5), (b, (logits[b, :len(r)] - alone).abs().max())
print("each padded row matches the row run alone")
