# unslothai/unsloth-zoo#342 (commit c8b204f9, "Fix/video collate"), unsloth_zoo/vision_utils.py
# UnslothVisionDataCollator._collate_prompt_completion, Gemma 3 prompt-completion SFT.
#
# Bug: prompts (images + text) are processed LEFT-padded and completions RIGHT-padded, the two are
# concatenated and `_flush_to_side` compacts the real tokens of each row to the tokenizer's padding side.
# The output is built as `dict(proc_prompts)`, so the `token_type_ids` Gemma 3 needs for its bidirectional
# image block are the prompt processor's: prompt length and still in the left-padded layout, not
# concatenated with the completion's nor moved by the flush. On a row whose prompt was padded, the image
# block the model builds no longer sits on the image tokens.
# Fix: concatenate prompt and completion token_type_ids and flush / truncate / pad them with input_ids.
#
# The model side follows transformers' Gemma 3 (4.57: token_type_ids_mask_function with safe indices,
# or-ed onto the causal mask, and-ed with padding), one tiny eager layer.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

IGNORE_INDEX = -100
PAD_ID = 0
BOI_ID, IMAGE_ID, EOI_ID = 5, 6, 7
MM_TOKENS_PER_IMAGE = 4
VOCAB = 40


class TinyGemma3Processor:
    """Stand-in for Gemma3Processor: expands <start_of_image> into the image tokens, token_type_ids = 1 on them."""

    def __init__(self):
        self.tokenizer = type("Tok", (), {"padding_side": "right", "pad_token_id": PAD_ID})()

    def __call__(self, text, images=None, padding=True, padding_side="right", return_tensors="pt", add_special_tokens=False):
        rows = []
        for t in text:
            ids = []
            for tok in t:
                if tok == BOI_ID:
                    ids += [BOI_ID] + [IMAGE_ID] * MM_TOKENS_PER_IMAGE + [EOI_ID]
                else:
                    ids.append(tok)
            rows.append(ids)
        L = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), L), PAD_ID, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(L - len(r), L) if padding_side == "left" else slice(0, len(r))
            input_ids[i, sl] = torch.tensor(r)
            attention_mask[i, sl] = 1
        out = {"input_ids": input_ids, "attention_mask": attention_mask,
               "token_type_ids": (input_ids == IMAGE_ID).long()}
        if images is not None:
            out["pixel_values"] = torch.stack([im[0] for im in images])
        return out


class UnslothVisionDataCollator:
    def __init__(self, processor, completion_only_loss=True):
        self.processor = processor
        self.completion_only_loss = completion_only_loss
        self.ignore_index = IGNORE_INDEX
        self.padding_token_ids = torch.tensor([PAD_ID, IMAGE_ID])

    def _tokenizer_padding_side(self) -> str:
        tok = getattr(self.processor, "tokenizer", self.processor)
        side = getattr(tok, "padding_side", "right")
        return "left" if side == "left" else "right"

    def _pad_token_id_or_fail(self) -> int:
        return self.processor.tokenizer.pad_token_id

    def _flush_to_side(self, attention_mask, input_ids, side, pad_token_id, extra_masks=None):
        """Compact non-pad tokens toward `side`. Returns (attn, ids, extras...)."""
        B, L = input_ids.shape
        new_ids = torch.full_like(input_ids, pad_token_id)
        new_attn = torch.zeros_like(attention_mask)
        new_extras = None
        if extra_masks is not None:
            new_extras = [torch.zeros_like(m) for m in extra_masks]
        keep = attention_mask.bool()
        for i in range(B):
            k = int(attention_mask[i].sum().item())
            if k == 0:
                continue
            src = input_ids[i][keep[i]]
            if side == "left":
                new_ids[i, L - k:] = src
                new_attn[i, L - k:] = 1
                if new_extras is not None:
                    for idx, m in enumerate(extra_masks):
                        new_extras[idx][i, L - k:] = m[i][keep[i]]
            else:
                new_ids[i, :k] = src
                new_attn[i, :k] = 1
                if new_extras is not None:
                    for idx, m in enumerate(extra_masks):
                        new_extras[idx][i, :k] = m[i][keep[i]]
        if new_extras is None:
            return new_attn, new_ids, ()
        return new_attn, new_ids, tuple(new_extras)

    def __call__(self, examples):
        return self._collate_prompt_completion(examples)

    def _collate_prompt_completion(self, examples):
        prompt_texts = [ex["prompt"] for ex in examples]
        completion_texts = [ex["completion"] for ex in examples]
        images = [ex["images"] for ex in examples]

        # Encode prompts (LEFT pad) with images
        proc_prompts = self.processor(images=images, text=prompt_texts, padding=True, padding_side="left",
                                      return_tensors="pt", add_special_tokens=False)
        # Encode completions (RIGHT pad) text-only
        proc_completions = self.processor(text=completion_texts, padding=True, padding_side="right",
                                          return_tensors="pt", add_special_tokens=False)

        p_ids, c_ids = proc_prompts["input_ids"], proc_completions["input_ids"]
        p_m, c_m = proc_prompts["attention_mask"], proc_completions["attention_mask"]
        input_ids = torch.cat((p_ids, c_ids), dim=1)
        attention_mask = torch.cat((p_m, c_m), dim=1)
        completion_mask = torch.cat((torch.zeros_like(p_m), c_m), dim=1)
        if FIXED:
            p_tt, c_tt = proc_prompts.get("token_type_ids", None), proc_completions.get("token_type_ids", None)
            if p_tt is not None and c_tt is not None:
                token_type_ids = torch.cat((p_tt, c_tt), dim=1)
            else:
                token_type_ids = None
        else:
            token_type_ids = None

        # Flush to tokenizer default padding side
        pad_id = self._pad_token_id_or_fail()
        flush_side = self._tokenizer_padding_side()
        if token_type_ids is not None:
            attention_mask, input_ids, (completion_mask, token_type_ids) = self._flush_to_side(
                attention_mask, input_ids, flush_side, pad_id, (completion_mask, token_type_ids)
            )
        else:
            attention_mask, input_ids, (completion_mask,) = self._flush_to_side(
                attention_mask, input_ids, flush_side, pad_id, (completion_mask,)
            )

        # Labels: mask attention pads + image/pad tokens; completion-only if requested
        labels = input_ids.clone()
        labels[attention_mask == 0] = self.ignore_index
        labels[torch.isin(labels, self.padding_token_ids)] = self.ignore_index
        if self.completion_only_loss:
            labels[completion_mask == 0] = self.ignore_index

        # Build output (keep pixel_values from prompt batch)
        out = dict(proc_prompts)
        out["input_ids"] = input_ids
        out["attention_mask"] = attention_mask
        out["labels"] = labels
        if token_type_ids is not None:
            out["token_type_ids"] = token_type_ids
        return out


def token_type_ids_mask_function(token_type_ids, image_group_ids):
    def inner_mask(batch_idx, q_idx, kv_idx):
        safe_q_idx = torch.where(q_idx < token_type_ids.shape[1], q_idx, 0)
        safe_kv_idx = torch.where(kv_idx < token_type_ids.shape[1], kv_idx, 0)
        token_type_ids_at_q_idx = token_type_ids[batch_idx, safe_q_idx]
        token_type_ids_at_q_idx = torch.where(q_idx < token_type_ids.shape[1], token_type_ids_at_q_idx, 0)
        token_type_ids_at_kv_idx = token_type_ids[batch_idx, safe_kv_idx]
        token_type_ids_at_kv_idx = torch.where(kv_idx < token_type_ids.shape[1], token_type_ids_at_kv_idx, 0)
        image_group_ids_at_q_idx = image_group_ids[batch_idx, safe_q_idx]
        image_group_ids_at_q_idx = torch.where(q_idx < image_group_ids.shape[1], image_group_ids_at_q_idx, -1)
        image_group_ids_at_kv_idx = image_group_ids[batch_idx, safe_kv_idx]
        image_group_ids_at_kv_idx = torch.where(kv_idx < image_group_ids.shape[1], image_group_ids_at_kv_idx, -1)
        is_image_block = (token_type_ids_at_q_idx == 1) & (token_type_ids_at_kv_idx == 1)
        same_image_block = image_group_ids_at_q_idx == image_group_ids_at_kv_idx
        return is_image_block & same_image_block
    return inner_mask


class TinyGemma3ForConditionalGeneration(nn.Module):
    def __init__(self, hidden=32, heads=4, patch_dim=12):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, hidden)
        self.multi_modal_projector = nn.Linear(patch_dim, hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 64), nn.GELU(), nn.Linear(64, hidden))
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)
        self.heads = heads

    def forward(self, input_ids, attention_mask, pixel_values, labels, token_type_ids=None):
        B, L = input_ids.shape
        x = self.embed_tokens(input_ids)
        image_features = self.multi_modal_projector(pixel_values)  # (B, MM_TOKENS_PER_IMAGE, hidden)
        special_image_mask = (input_ids == IMAGE_ID).unsqueeze(-1).expand_as(x)
        x = x.masked_scatter(special_image_mask, image_features.reshape(-1, x.shape[-1]))

        b = torch.arange(B).view(B, 1, 1)
        q = torch.arange(L).view(1, L, 1)
        k = torch.arange(L).view(1, 1, L)
        mask = k <= q
        if token_type_ids is not None:
            is_image = (token_type_ids == 1).to(x.device)
            is_previous_image = nn.functional.pad(is_image, (1, 0), value=0)[:, :-1]
            new_image_start = is_image & ~is_previous_image
            image_group_ids = torch.cumsum(new_image_start.int(), dim=1) - 1
            image_group_ids = torch.where(is_image, image_group_ids, -1)
            mask = mask | token_type_ids_mask_function(token_type_ids, image_group_ids)(b, q, k)
        mask = mask & attention_mask.bool()[:, None, :]
        bias = torch.zeros(B, 1, L, L).masked_fill(~mask[:, None], torch.finfo(x.dtype).min)

        hd = x.shape[-1] // self.heads
        qs = self.q_proj(x).view(B, L, self.heads, hd).transpose(1, 2)
        ks = self.k_proj(x).view(B, L, self.heads, hd).transpose(1, 2)
        vs = self.v_proj(x).view(B, L, self.heads, hd).transpose(1, 2)
        w = torch.softmax(qs @ ks.transpose(-1, -2) / hd ** 0.5 + bias, dim=-1)
        h = x + self.o_proj((w @ vs).transpose(1, 2).reshape(B, L, -1))
        h = h + self.mlp(h)
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
        return loss, logits


processor = TinyGemma3Processor()
collator = UnslothVisionDataCollator(processor)
model = TinyGemma3ForConditionalGeneration()

examples = [
    {"prompt": [2, 9, BOI_ID, 11, 12, 13, 14, 15], "completion": [20, 21, 22, 1],
     "images": [torch.randn(1, MM_TOKENS_PER_IMAGE, 12)]},
    {"prompt": [2, BOI_ID, 16, 17], "completion": [23, 24, 25, 26, 27, 1],
     "images": [torch.randn(1, MM_TOKENS_PER_IMAGE, 12)]},
]
batch = collator(examples)
model.train()
loss, logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     pixel_values=batch["pixel_values"], labels=batch["labels"],
                     token_type_ids=batch.get("token_type_ids"))
loss.backward()
print("input_ids", batch["input_ids"].tolist())
print("token_type_ids", batch["token_type_ids"].tolist())
print("loss", round(loss.item(), 6))
