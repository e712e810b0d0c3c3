# TensorAuto/OpenTau#236 (commit e24ba88, reverted in 9e09eba and re-applied to pi07 as #242, commit b65f972):
# "fix(pi07): align text attention with paper §VI.B + Fig. 19".
# PI07HighLevelPlannerModel.embed_prefix (src/opentau/policies/pi07/high_level_planner/modeling_pi07_high_level.py)
# builds a 1-D `att_masks` list that make_att_2d_masks turns into a block-causal 2-D mask through a cumsum.
# Before the fix the language prompt continued the bidirectional image block (`[0] * num_lang_embs`), the
# metadata span, the "Updated Memory: " and "Subtask: " indicators were bidirectional blocks
# (`[1] + [0] * (N - 1)`) and the ";\n " separator continued the metadata block (`[0] * N`), while the paper
# says every text token after the image block is causal. The fix emits `[1] * N` for every text span.
# Trimmed port: a tiny Gemma-like eager-attention stack stands in for gemma3_with_expert; the prefix layout,
# make_att_2d_masks, the position ids and the response CE slice follow the project's code.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class PI07HighLevelPlannerConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 2
    num_image_tokens: int = 4
    prompt_max_length: int = 6
    metadata_max_length: int = 3
    memory_max_length: int = 3
    response_max_length: int = 4


class TinyTokenizer:
    # fixed spans of the prompt template, as token ids
    table = {";\n ": [5, 6], "Updated Memory: ": [7, 8, 9], "Subtask: ": [10, 11]}

    def encode(self, text, add_special_tokens=False):
        return list(self.table[text])


def make_att_2d_masks(pad_masks, att_masks):
    if att_masks.ndim != 2:
        raise ValueError(att_masks.ndim)
    if pad_masks.ndim != 2:
        raise ValueError(pad_masks.ndim)

    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    att_2d_masks = att_2d_masks & pad_2d_masks
    return att_2d_masks


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, position_ids, base=10000.0):
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = position_ids[..., None].float() * inv_freq  # (B, L, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, L, d)
    return x * emb.cos() + rotate_half(x) * emb.sin()


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h = cfg.num_heads
        self.dh = cfg.hidden_size // cfg.num_heads
        self.norm1 = nn.LayerNorm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.o = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size), nn.GELU(),
                                 nn.Linear(4 * cfg.hidden_size, cfg.hidden_size))

    def eager_attention_forward(self, attention_mask, q, k, v):
        att_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.dh)
        big_neg = -2.3819763e38  # See gemma/modules.py
        masked_att_weights = torch.where(attention_mask[:, None, :, :], att_weights, big_neg)
        probs = F.softmax(masked_att_weights, dim=-1)
        return torch.matmul(probs, v)

    def forward(self, x, attention_mask, position_ids):
        b, l, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, l, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, position_ids), apply_rope(k, position_ids)
        a = self.eager_attention_forward(attention_mask, q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, l, -1))
        return x + self.mlp(self.norm2(x))


class Gemma3WithExpertStandIn(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.img_proj = nn.Linear(12, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed_image(self, img):  # (B, num_patches, 12) patch features
        return self.img_proj(img)

    def embed_language_tokens(self, tokens):
        return self.embed(tokens) * math.sqrt(self.embed.embedding_dim)

    def _lm_head(self):
        return self.lm_head

    def forward(self, attention_mask, position_ids, inputs_embeds):
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, attention_mask, position_ids)
        return self.norm(x)


class PI07HighLevelPlannerModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.language_tokenizer = TinyTokenizer()
        self.gemma3_with_expert = Gemma3WithExpertStandIn(config)

    def embed_prefix(self, images, img_masks, lang_tokens, lang_masks, response_tokens=None,
                     response_masks=None, memory_tokens=None, memory_masks=None,
                     metadata_tokens=None, metadata_masks=None):
        embs = []
        pad_masks = []
        att_masks = []

        for img, img_mask in zip(images, img_masks, strict=False):
            img_emb = self.gemma3_with_expert.embed_image(img)
            bsize, num_img_embs = img_emb.shape[:2]
            img_mask = img_mask[:, None].expand(bsize, num_img_embs)
            embs.append(img_emb)
            pad_masks.append(img_mask)
            # Create attention masks so that image tokens attend to each other
            att_masks += [0] * num_img_embs

        lang_emb = self.gemma3_with_expert.embed_language_tokens(lang_tokens)
        embs.append(lang_emb)
        pad_masks.append(lang_masks)

        num_lang_embs = lang_emb.shape[1]
        if FIXED:
            # Per π0.7 paper §VI.B: "The following text tokens use causal attention".
            att_masks += [1] * num_lang_embs
        else:
            # full attention between image and language inputs
            att_masks += [0] * num_lang_embs

        has_metadata = (
            metadata_tokens is not None and metadata_masks is not None and bool(metadata_masks.any())
        )
        if has_metadata:
            metadata_emb = self.gemma3_with_expert.embed_language_tokens(metadata_tokens)
            embs.append(metadata_emb)
            pad_masks.append(metadata_masks)
            if FIXED:
                att_masks += [1] * metadata_emb.shape[1]
            else:
                att_masks += [1] + [0] * (metadata_emb.shape[1] - 1)

            prefix_end_indicator_ids = self.language_tokenizer.encode(";\n ", add_special_tokens=False)
            prefix_end_tokens = torch.tensor([prefix_end_indicator_ids] * bsize, dtype=torch.long)
            prefix_end_emb = self.gemma3_with_expert.embed_language_tokens(prefix_end_tokens)
            num_prefix_end_embs = prefix_end_emb.shape[1]
            prefix_end_mask = torch.ones(bsize, num_prefix_end_embs, dtype=torch.bool)
            embs.append(prefix_end_emb)
            pad_masks.append(prefix_end_mask)
            if FIXED:
                att_masks += [1] * num_prefix_end_embs
            else:
                att_masks += [0] * num_prefix_end_embs

        memory_start_indicator_ids = self.language_tokenizer.encode("Updated Memory: ", add_special_tokens=False)
        memory_start_tokens = torch.tensor([memory_start_indicator_ids] * bsize, dtype=torch.long)
        memory_start_emb = self.gemma3_with_expert.embed_language_tokens(memory_start_tokens)
        num_memory_start_embs = memory_start_emb.shape[1]
        memory_start_mask = torch.ones(bsize, num_memory_start_embs, dtype=torch.bool)
        embs.append(memory_start_emb)
        pad_masks.append(memory_start_mask)
        if FIXED:
            att_masks += [1] * num_memory_start_embs
        else:
            att_masks += [1] + [0] * (num_memory_start_embs - 1)

        if memory_tokens is not None:
            memory_emb = self.gemma3_with_expert.embed_language_tokens(memory_tokens)
            embs.append(memory_emb)
            pad_masks.append(memory_masks)
            num_memory_embs = memory_emb.shape[1]
            att_masks += [1] * num_memory_embs

        if response_tokens is not None:
            response_start_indicator_ids = self.language_tokenizer.encode("Subtask: ", add_special_tokens=False)
            response_start_tokens = torch.tensor([response_start_indicator_ids] * bsize, dtype=torch.long)
            response_start_emb = self.gemma3_with_expert.embed_language_tokens(response_start_tokens)
            num_response_start_embs = response_start_emb.shape[1]
            response_start_mask = torch.ones(bsize, num_response_start_embs, dtype=torch.bool)
            embs.append(response_start_emb)
            pad_masks.append(response_start_mask)
            if FIXED:
                att_masks += [1] * num_response_start_embs
            else:
                att_masks += [1] + [0] * (num_response_start_embs - 1)

            response_emb = self.gemma3_with_expert.embed_language_tokens(response_tokens)
            embs.append(response_emb)
            pad_masks.append(response_masks)
            num_response_embs = response_emb.shape[1]
            att_masks += [1] * num_response_embs

        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool, device=pad_masks.device)
        att_masks = att_masks[None, :].expand(bsize, len(att_masks))
        return embs, pad_masks, att_masks

    def forward(self, images, img_masks, lang_tokens, lang_masks, response_tokens, response_masks,
                memory_tokens, memory_masks, metadata_tokens, metadata_masks):
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(
            images, img_masks, lang_tokens, lang_masks, response_tokens, response_masks,
            memory_tokens, memory_masks, metadata_tokens, metadata_masks,
        )
        vlm_2d_attention_mask = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
        vlm_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1

        prefix_out = self.gemma3_with_expert.forward(
            attention_mask=vlm_2d_attention_mask,
            position_ids=vlm_position_ids,
            inputs_embeds=prefix_embs,
        )

        batch_size, seq_len = response_tokens.shape
        response_token_start = -self.config.response_max_length
        response_token_end = -1
        response_out = prefix_out[:, slice(response_token_start, response_token_end)]
        response_logits = self.gemma3_with_expert._lm_head()(response_out).float()
        response_logits = response_logits.reshape(-1, response_logits.shape[-1])
        response_labels = response_tokens[:, 1:].reshape(-1)
        response_ce_loss = F.cross_entropy(response_logits, response_labels, reduction="none")
        response_ce_loss = response_ce_loss.reshape(batch_size, seq_len - 1)
        response_is_pad = ~response_masks
        response_ce_loss = response_ce_loss * ~response_is_pad[:, 1:]
        response_ce_loss = response_ce_loss.sum() / (~response_is_pad[:, 1:]).sum().clamp(min=1)
        return {"MSE": torch.zeros(()), "CE": response_ce_loss}


def main():
    torch.manual_seed(0)
    cfg = PI07HighLevelPlannerConfig()
    model = PI07HighLevelPlannerModel(cfg).eval()
    B = 2
    images = [torch.randn(B, cfg.num_image_tokens, 12), torch.randn(B, cfg.num_image_tokens, 12)]
    img_masks = [torch.ones(B, dtype=torch.bool), torch.tensor([True, False])]
    # prompts right-padded to prompt_max_length
    lang_tokens = torch.randint(12, cfg.vocab_size, (B, cfg.prompt_max_length))
    lang_masks = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    metadata_tokens = torch.randint(12, cfg.vocab_size, (B, cfg.metadata_max_length))
    metadata_masks = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    memory_tokens = torch.randint(12, cfg.vocab_size, (B, cfg.memory_max_length))
    memory_masks = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    response_tokens = torch.randint(12, cfg.vocab_size, (B, cfg.response_max_length))
    response_masks = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)

    with torch.no_grad():
        out = model(images, img_masks, lang_tokens, lang_masks, response_tokens, response_masks,
                    memory_tokens, memory_masks, metadata_tokens, metadata_masks)
    print("fixed" if FIXED else "buggy", "response CE:", round(out["CE"].item(), 6))


if __name__ == "__main__":
    main()
