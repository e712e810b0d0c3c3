# PixArt-sigma (PixArt-alpha/PixArt-sigma commit d5adc75, "bug fixed"): train_scripts/train.py encodes the CFG null
# prompt "" with attention_mask=txt_tokens.attention_mask (the last validation prompt's padding mask) instead of
# null_tokens.attention_mask, so the T5 encoder attends to ~all padding tokens when building uncond_prompt_embeds.
import sys
import torch
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyT5Tokenizer:
    """Stand-in for T5Tokenizer: word-level ids, </s>=1 appended, pad=0 on the right, padding='max_length'."""
    pad_token_id, eos_token_id = 0, 1

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def __call__(self, text, max_length, padding="max_length", truncation=True, return_tensors="pt"):
        ids = [2 + (sum(ord(c) * 31 ** j for j, c in enumerate(w)) % (self.vocab_size - 2)) for w in text.split()]
        ids = ids[: max_length - 1] + [self.eos_token_id]
        mask = [1] * len(ids) + [0] * (max_length - len(ids))
        ids = ids + [self.pad_token_id] * (max_length - len(ids))
        return _BatchEncoding(input_ids=torch.tensor([ids]), attention_mask=torch.tensor([mask]))


class _BatchEncoding(dict):
    def __getattr__(self, k):
        return self[k]

    def to(self, device):
        return _BatchEncoding({k: v.to(device) for k, v in self.items()})


max_length = 24
config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, dropout_rate=0.0)
text_encoder = T5EncoderModel(config).eval()
tokenizer = TinyT5Tokenizer(config.vocab_size)
device = "cpu"
saved = {}

with torch.no_grad():
    # preparing embeddings for visualization (train_scripts/train.py)
    validation_prompts = [
        "dog",
        "portrait photo of a girl, photograph, highly detailed face, depth of field",
        "Self-portrait oil painting, a beautiful cyborg with golden hair, 8k",
        "Astronaut in a jungle, cold color palette, muted colors, detailed, 8k",
        "A photo of beautiful mountain with realistic sunset and blue lake, highly detailed, masterpiece",
    ]
    for prompt in validation_prompts:
        txt_tokens = tokenizer(
            prompt, max_length=max_length, padding="max_length", truncation=True, return_tensors="pt"
        ).to(device)
        caption_emb = text_encoder(txt_tokens.input_ids, attention_mask=txt_tokens.attention_mask)[0]
        saved[f"{prompt}_{max_length}token"] = {"caption_embeds": caption_emb, "emb_mask": txt_tokens.attention_mask}
    null_tokens = tokenizer(
        "", max_length=max_length, padding="max_length", truncation=True, return_tensors="pt"
    ).to(device)
    if FIXED:
        null_token_emb = text_encoder(null_tokens.input_ids, attention_mask=null_tokens.attention_mask)[0]
    else:
        null_token_emb = text_encoder(null_tokens.input_ids, attention_mask=txt_tokens.attention_mask)[0]
    saved[f"null_embed_diffusers_{max_length}token"] = {
        "uncond_prompt_embeds": null_token_emb, "uncond_prompt_embeds_mask": null_tokens.attention_mask}

    # reference: the null prompt encoded alone, without any padding
    n_real = int(null_tokens.attention_mask.sum())
    ref = text_encoder(null_tokens.input_ids[:, :n_real])[0]
    got = saved[f"null_embed_diffusers_{max_length}token"]["uncond_prompt_embeds"][:, :n_real]

print(f"null prompt: {n_real} real token(s), mask used attends to "
      f"{int((txt_tokens.attention_mask if not FIXED else null_tokens.attention_mask).sum())} keys")
print(f"max |uncond_prompt_embeds[real] - unpadded encoding| = {(got - ref).abs().max().item():.6f}")
