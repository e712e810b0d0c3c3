# Correct program (quiet batch quiet-r77b).
# Ported from huggingface/evaluate @a7dd338386a4fae9a1767e05eb9ef9479513d9e8 (file last changed in
# f05792fff67a356f696fdf17ac64bd99602794c4): metrics/perplexity/perplexity.py, Perplexity._compute.
# The texts are tokenized together (add_special_tokens=False, padding=True, truncation to max_length - 1 to leave
# room for <BOS>), right-padded as GPT-2's tokenizer pads; GPT-2 has no pad token, so with batch_size > 1 the
# metric assigns the first existing special token (<|endoftext|>, which is also BOS and EOS) as the pad token.
# Each batch gets a BOS column prepended with attention 1, runs through the model with that attention_mask, and the
# shifted cross-entropy is weighted by attn_mask[..., 1:] so that only real targets count; perplexity per text is
# exp(sum / count).
# The tokenizer is a small word-level stand-in with GPT-2's special-token layout; the model is a tiny
# GPT2LMHeadModel built from GPT2Config.
# Self-check: every text's perplexity equals a reference computed by running <BOS> + that text alone (batch of one,
# no padding, same truncation) and summing each target token's negative log-prob in a double loop
# (texts x tokens); batch_size 1 (no padding) gives the same numbers too.
import numpy as np
import torch
from torch.nn import CrossEntropyLoss
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)


class BatchEncoding(dict):
    def to(self, device):
        return BatchEncoding({k: v.to(device) for k, v in self.items()})


class WordTokenizer:
    """Word-level stand-in for GPT-2's tokenizer: one special token <|endoftext|> (bos = eos = unk), no pad token,
    pads on the right, truncates on the right."""

    def __init__(self, words):
        self.vocab = {}
        for w in words:
            self.vocab.setdefault(w, len(self.vocab))
        self.vocab["<|endoftext|>"] = len(self.vocab)
        self.bos_token = self.eos_token = self.unk_token = "<|endoftext|>"
        self.pad_token = None
        self.padding_side = "right"

    @property
    def special_tokens_map_extended(self):
        out = {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token}
        if self.pad_token is not None:
            out["pad_token"] = self.pad_token
        return out

    def add_special_tokens(self, mapping):
        for k, v in mapping.items():
            setattr(self, k, v)

    @property
    def bos_token_id(self):
        return self.vocab[self.bos_token]

    @property
    def pad_token_id(self):
        return None if self.pad_token is None else self.vocab[self.pad_token]

    def __call__(self, texts, add_special_tokens=False, padding=True, truncation=False, max_length=None,
                 return_tensors="pt", return_attention_mask=True):
        ids = [[self.vocab[w] for w in t.split()] for t in texts]
        if truncation and max_length:
            ids = [x[:max_length] for x in ids]
        longest = max(len(x) for x in ids)
        if padding and any(len(x) != longest for x in ids):
            assert self.pad_token is not None
        input_ids = [x + [self.pad_token_id] * (longest - len(x)) for x in ids]
        attention_mask = [[1] * len(x) + [0] * (longest - len(x)) for x in ids]
        return BatchEncoding(input_ids=torch.tensor(input_ids), attention_mask=torch.tensor(attention_mask))


# ---------------------------------------------------------------- metrics/perplexity/perplexity.py
class Perplexity:
    def __init__(self, model, tokenizer):
        # stands for AutoModelForCausalLM.from_pretrained(model_id) / AutoTokenizer.from_pretrained(model_id)
        self.model = model
        self.tokenizer = tokenizer

    def _compute(self, predictions, batch_size: int = 16, add_start_token: bool = True, device=None, max_length=None):
        if device is not None:
            assert device in ["gpu", "cpu", "cuda"], "device should be either gpu or cpu."
            if device == "gpu":
                device = "cuda"
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"

        model = self.model
        model = model.to(device)

        tokenizer = self.tokenizer

        # if batch_size > 1 (which generally leads to padding being required), and
        # if there is not an already assigned pad_token, assign an existing
        # special token to also be the padding token
        if tokenizer.pad_token is None and batch_size > 1:
            existing_special_tokens = list(tokenizer.special_tokens_map_extended.values())
            assert (
                len(existing_special_tokens) > 0
            ), "If batch_size > 1, model must have at least one special token to use for padding."
            tokenizer.add_special_tokens({"pad_token": existing_special_tokens[0]})

        if add_start_token and max_length:
            # leave room for <BOS> token to be added:
            assert tokenizer.bos_token is not None
            max_tokenized_len = max_length - 1
        else:
            max_tokenized_len = max_length

        encodings = tokenizer(
            predictions,
            add_special_tokens=False,
            padding=True,
            truncation=True if max_tokenized_len else False,
            max_length=max_tokenized_len,
            return_tensors="pt",
            return_attention_mask=True,
        ).to(device)

        encoded_texts = encodings["input_ids"]
        attn_masks = encodings["attention_mask"]

        # check that each input is long enough:
        if add_start_token:
            assert torch.all(torch.ge(attn_masks.sum(1), 1)), "Each input text must be at least one token long."
        else:
            assert torch.all(torch.ge(attn_masks.sum(1), 2))

        ppls = []
        loss_fct = CrossEntropyLoss(reduction="none")

        for start_index in range(0, len(encoded_texts), batch_size):
            end_index = min(start_index + batch_size, len(encoded_texts))
            encoded_batch = encoded_texts[start_index:end_index]
            attn_mask = attn_masks[start_index:end_index]

            if add_start_token and tokenizer.bos_token_id is not None:
                bos_tokens_tensor = torch.tensor([[tokenizer.bos_token_id]] * encoded_batch.size(dim=0)).to(device)
                encoded_batch = torch.cat([bos_tokens_tensor, encoded_batch], dim=1)
                attn_mask = torch.cat(
                    [torch.ones(bos_tokens_tensor.size(), dtype=torch.int64).to(device), attn_mask], dim=1
                )

            labels = encoded_batch

            with torch.no_grad():
                out_logits = model(encoded_batch, attention_mask=attn_mask).logits

            shift_logits = out_logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            shift_attention_mask_batch = attn_mask[..., 1:].contiguous()

            perplexity_batch = torch.exp(
                (loss_fct(shift_logits.transpose(1, 2), shift_labels) * shift_attention_mask_batch).sum(1)
                / shift_attention_mask_batch.sum(1)
            )

            ppls += perplexity_batch.tolist()

        return {"perplexities": ppls, "mean_perplexity": np.mean(ppls)}


# ---------------------------------------------------------------- data + model
WORDS = "the a cat dog sat ran on under mat table red blue green sky sea grass is was and of to in it".split()
tok = WordTokenizer(WORDS)
config = GPT2Config(vocab_size=len(tok.vocab), n_positions=32, n_embd=32, n_layer=2, n_head=4,
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.bos_token_id)
model = GPT2LMHeadModel(config).eval()

texts = [
    "the cat sat on the mat",
    "a dog ran",
    "the sky is blue and the sea is blue and the grass is green",
    "it was red",
    "the dog sat under the table and the cat ran to the mat in the sea",
    "green",
    "the red cat and the blue dog",
]
MAX_LENGTH = 12

metric = Perplexity(model, tok)
batched = metric._compute(texts, batch_size=3, device="cpu", max_length=MAX_LENGTH)["perplexities"]
assert tok.pad_token_id == tok.bos_token_id  # padding id is <|endoftext|>, as for GPT-2


# ---------------------------------------------------------------- reference: one text at a time, no padding
def reference_ppl(text):
    ids = [tok.vocab[w] for w in text.split()][: MAX_LENGTH - 1]
    ids = [tok.bos_token_id] + ids
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    nll = 0.0
    for t in range(1, len(ids)):
        nll -= logp[t - 1, ids[t]].item()
    return float(np.exp(nll / (len(ids) - 1)))


refs = [reference_ppl(t) for t in texts]
np.testing.assert_allclose(batched, refs, rtol=1e-4)
assert sum(len(t.split()) > MAX_LENGTH - 1 for t in texts) > 0  # truncation happens
unbatched = Perplexity(model, tok)._compute(texts, batch_size=1, device="cpu", max_length=MAX_LENGTH)["perplexities"]
np.testing.assert_allclose(unbatched, refs, rtol=1e-4)
print("ok: batched perplexities match the per-text unpadded reference", [round(p, 3) for p in batched])
