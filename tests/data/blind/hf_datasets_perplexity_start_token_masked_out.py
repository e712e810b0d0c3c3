# huggingface/datasets#4258: the perplexity metric prepended a BOS start token but gave it 0 in the
# attention mask, so every text in a padded batch was scored without attending to its start token.
import sys

import numpy as np
import torch
from torch.nn import CrossEntropyLoss
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BOS_ID, PAD_ID = 1, 1  # gpt2: bos == eos, and the pad token is "an existing special token"


class TinyTokenizer:
    """Stand-in for AutoTokenizer(gpt2): character ids, right padding, add_special_tokens=False."""

    bos_token_id = BOS_ID
    pad_token_id = PAD_ID

    def __call__(self, texts, max_length):
        ids = [[2 + (ord(ch) % 60) for ch in t][:max_length] for t in texts]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, : len(x)] = torch.tensor(x)
            attention_mask[i, : len(x)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class Perplexity:
    def _compute(self, input_texts, model, tokenizer, batch_size=16, add_start_token=True, device="cpu"):
        if add_start_token:
            max_tokenized_len = model.config.n_positions - 1
        else:
            max_tokenized_len = model.config.n_positions

        encodings = tokenizer(input_texts, max_length=max_tokenized_len)
        encoded_texts = encodings["input_ids"].to(device)
        attn_masks = encodings["attention_mask"].to(device)

        ppls = []
        loss_fct = CrossEntropyLoss(reduction="none")

        for start_index in range(0, len(encoded_texts), batch_size):
            end_index = min(start_index + batch_size, len(encoded_texts))
            encoded_batch = encoded_texts[start_index:end_index]
            attn_mask = attn_masks[start_index:end_index]

            if add_start_token:
                bos_tokens_tensor = torch.tensor([[tokenizer.bos_token_id]] * encoded_batch.size(dim=0)).to(device)
                encoded_batch = torch.cat([bos_tokens_tensor, encoded_batch], dim=1)
                if FIXED:
                    start_mask = torch.ones(bos_tokens_tensor.size(), dtype=torch.int64).to(device)
                else:
                    start_mask = torch.zeros(bos_tokens_tensor.size(), dtype=torch.int64).to(device)
                attn_mask = torch.cat([start_mask, attn_mask], dim=1)

            labels = encoded_batch

            with torch.no_grad():
                out_logits = model(encoded_batch, attention_mask=attn_mask).logits

            shift_logits = out_logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            shift_attention_mask_batch = attn_mask[..., 1:].contiguous()

            perplexity_batch = torch.exp2(
                (loss_fct(shift_logits.transpose(1, 2), shift_labels) * shift_attention_mask_batch).sum(1)
                / shift_attention_mask_batch.sum(1)
            )
            ppls += perplexity_batch.tolist()

        return {"perplexities": ppls, "mean_perplexity": np.mean(ppls)}


def reference_perplexity(model, tokenizer, text):
    ids = tokenizer([text], max_length=63)["input_ids"]
    ids = torch.cat([torch.tensor([[BOS_ID]]), ids], dim=1)
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits
    nll = CrossEntropyLoss(reduction="none")(logits[0, :-1], ids[0, 1:])
    return torch.exp2(nll.mean()).item()


def main():
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=BOS_ID, eos_token_id=BOS_ID, pad_token_id=PAD_ID)
    model = GPT2LMHeadModel(config).eval()
    tokenizer = TinyTokenizer()
    texts = ["lorem ipsum dolor sit amet", "hello world", "the quick brown fox jumps", "abc"]

    result = Perplexity()._compute(texts, model, tokenizer, batch_size=4, add_start_token=True)
    ref = [reference_perplexity(model, tokenizer, t) for t in texts]
    diff = max(abs(a - b) for a, b in zip(result["perplexities"], ref))
    print("fixed" if FIXED else "buggy", "mean_perplexity", round(result["mean_perplexity"], 4),
          "max |ppl - unbatched reference|", round(diff, 6))


if __name__ == "__main__":
    main()
