"""OpenTau value function: the value is read from the last prompt position, which is padding.

Citation: TensorAuto/OpenTau PR #524 "fix(value): learned <val> readout token + single shared norm head",
commit 4579ae3. Read in the upstream git history: src/opentau/policies/value/modeling_value.py
(`make_att_2d_masks`, `ValueFunction.prepare_language`, `ValueModel.embed_sequence` / `forward` / `get_value`)
and src/opentau/policies/value/siglip_gemma.py (`SiglipGemmaValueModel.forward` / `get_value`), before and after.

Bug: `prepare_language` right-pads the prompt to `prompt_max_length`; the sequence is [image tokens | prompt
(padded) | response (padded, training only)], masked by `make_att_2d_masks` (cumsum blocks & pad x pad). The
value head read `hidden_states[:, -1]` at inference and `hidden_states[:, -response_max_length - 1]` in training,
"the last language token" -- but that position is a pad slot of the prompt whenever the prompt is shorter than
`prompt_max_length`, so the readout carried nothing about the images or the prompt.

Fix: a learned `<val>` readout token (`value_token`, pad mask 1, att mask 1: a new block seeing the whole
real prefix) is inserted right after the prompt and before the response block; the value is read from it.

This program: tiny SigLIP vision / Gemma3 text configs (no download), the project's embed_sequence / 2-D mask /
cumsum positions, the bool 4-D mask handed to Gemma3TextModel as the {full, sliding} mapping, the training
forward (value + response logits) and predict-time get_value on two right-padded prompts.
"""

import math
import sys

import torch
from torch import nn
from transformers import Gemma3TextConfig, Gemma3TextModel, SiglipVisionConfig, SiglipVisionModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PROMPT_MAX_LENGTH = 10
RESPONSE_MAX_LENGTH = 4
NUM_VALUE_BINS = 11
HIDDEN = 32


def make_att_2d_masks(pad_masks, att_masks):
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    att_2d_masks = att_2d_masks & pad_2d_masks
    return att_2d_masks


class SiglipGemmaValueModel(nn.Module):
    def __init__(self, response_max_length):
        super().__init__()
        self.response_max_length = response_max_length
        self.vision_encoder = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            image_size=32, patch_size=16, vision_use_head=False))
        self.gemma = Gemma3TextModel(Gemma3TextConfig(
            vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=128, sliding_window=512,
            attn_implementation="sdpa"))
        self.value_head = nn.Linear(HIDDEN, NUM_VALUE_BINS)
        self.response_head = nn.Linear(HIDDEN, 64, bias=False)
        if FIXED:
            self.value_token = nn.Parameter(torch.zeros(1, 1, HIDDEN))
            nn.init.normal_(self.value_token, std=0.02)

    def embed_image(self, image):
        return self.vision_encoder(pixel_values=image).last_hidden_state

    def embed_language_tokens(self, tokens):
        return self.gemma.embed_tokens(tokens)

    def _run(self, inputs_embeds, attention_mask, position_ids):
        attention_mask = attention_mask[:, None, :, :]  # b n1 n2 -> b 1 n1 n2
        mask_mapping = {"full_attention": attention_mask, "sliding_attention": attention_mask}
        out = self.gemma(inputs_embeds=inputs_embeds, position_ids=position_ids, attention_mask=mask_mapping)
        return out.last_hidden_state

    def forward(self, inputs_embeds, attention_mask, position_ids):
        hidden_states = self._run(inputs_embeds, attention_mask, position_ids)
        classification_hidden = hidden_states[:, -self.response_max_length - 1, :]
        response_hidden = hidden_states[:, -self.response_max_length : -1, :]
        return self.value_head(classification_hidden), self.response_head(response_hidden)

    def get_value(self, inputs_embeds, attention_mask, position_ids):
        hidden_states = self._run(inputs_embeds, attention_mask, position_ids)
        value_hidden = hidden_states[:, -1, :]
        return self.value_head(value_hidden)


class ValueModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.siglip_gemma_value = SiglipGemmaValueModel(RESPONSE_MAX_LENGTH)
        self.multi_modal_proj = nn.Linear(24, HIDDEN)

    def embed_sequence(self, images, img_masks, lang_tokens, lang_masks, response_tokens=None, response_masks=None):
        embs, pad_masks, att_masks = [], [], []
        for img, img_mask in zip(images, img_masks):
            img_emb = self.multi_modal_proj(self.siglip_gemma_value.embed_image(img))
            bsize, num_img_embs = img_emb.shape[:2]
            embs.append(img_emb)
            pad_masks.append(img_mask[:, None].expand(bsize, num_img_embs))
            att_masks += [0] * num_img_embs

        lang_emb = self.siglip_gemma_value.embed_language_tokens(lang_tokens)
        embs.append(lang_emb)
        pad_masks.append(lang_masks)
        att_masks += [0] * lang_emb.shape[1]

        if FIXED:
            val_emb = self.siglip_gemma_value.value_token.to(dtype=embs[0].dtype)
            embs.append(val_emb.expand(bsize, 1, -1))
            pad_masks.append(torch.ones(bsize, 1, dtype=pad_masks[0].dtype))
            att_masks += [1]

        if response_tokens is not None:
            response_emb = self.siglip_gemma_value.embed_language_tokens(response_tokens)
            response_emb = response_emb * math.sqrt(response_emb.shape[-1])
            embs.append(response_emb)
            pad_masks.append(response_masks)
            att_masks += [1] * response_emb.shape[1]

        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool)[None, :].expand(bsize, len(att_masks))
        return embs, pad_masks, att_masks

    def forward(self, images, img_masks, lang_tokens, lang_masks, response_tokens, response_masks):
        embs, pad_masks, att_masks = self.embed_sequence(
            images, img_masks, lang_tokens, lang_masks, response_tokens, response_masks)
        att_2d_masks = make_att_2d_masks(pad_masks, att_masks)
        position_ids = torch.cumsum(pad_masks, dim=1) - 1
        return self.siglip_gemma_value.forward(embs, att_2d_masks, position_ids)

    def get_value(self, images, img_masks, lang_tokens, lang_masks):
        embs, pad_masks, att_masks = self.embed_sequence(images, img_masks, lang_tokens, lang_masks)
        att_2d_masks = make_att_2d_masks(pad_masks, att_masks)
        position_ids = torch.cumsum(pad_masks, dim=1) - 1
        return self.siglip_gemma_value.get_value(embs, att_2d_masks, position_ids)


def right_pad(rows, max_length):
    ids = torch.zeros(len(rows), max_length, dtype=torch.long)
    mask = torch.zeros(len(rows), max_length, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return ids, mask


def calculate_value(logits):
    start_idx = torch.linspace(-1, -1 / NUM_VALUE_BINS, NUM_VALUE_BINS)
    end_idx = torch.linspace(-1 + 1 / NUM_VALUE_BINS, 0, NUM_VALUE_BINS)
    mid_idx = ((start_idx + end_idx) / 2)[None, :]
    return (torch.softmax(logits, dim=-1) @ mid_idx.T)[:, 0]


def main():
    model = ValueModel().eval()
    images = [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32)]
    img_masks = [torch.ones(2, dtype=torch.bool), torch.tensor([True, False])]
    # "Task: ...<eos>State: ...<eos>" tokenized, padding="max_length", padding_side="right"
    lang_tokens, lang_masks = right_pad([[2, 5, 9, 11, 1, 7, 3, 1], [2, 6, 13, 1, 8, 1]], PROMPT_MAX_LENGTH)
    response_tokens, response_masks = right_pad([[2, 17, 18], [2, 21]], RESPONSE_MAX_LENGTH)

    with torch.no_grad():
        value_logits, response_logits = model(images, img_masks, lang_tokens, lang_masks,
                                              response_tokens, response_masks)
        target_bins = torch.tensor([3, 8])
        value_loss = nn.functional.cross_entropy(value_logits, target_bins)
        values = calculate_value(model.get_value(images, img_masks, lang_tokens, lang_masks))
    print("value loss", value_loss.item())
    print("predicted values", values.tolist())


if __name__ == "__main__":
    main()
