"""torchmultimodal FLAVA: the multimodal encoder runs over [image; text] with no padding mask.

Citation: facebookresearch/multimodal#530 ("FLAVA multimodal encoder bug": "why don't we pass an
attention mask to mask out '[PAD]' embeddings coming from text encoder?"), fix proposed in
facebookresearch/multimodal#545 ("Fix FLAVA bugs #530 and #533 (attention masks and CLS
tokens)", open when read). Read from the issue, the PR description and torchmultimodal's
models/flava/model.py; the encoder below is a small stand-in for flava_multimodal_encoder.

Bug: FLAVAModel.encode_mm projects the image and text hidden states, concatenates them and calls
``self.mm_encoder(fused_state)`` with no attention mask, so every image patch, the multimodal
CLS token and every real text token attend the [PAD] positions of shorter captions (the text
encoder itself did mask them, from pad_token_id).
Fix (#545): infer the text padding from the text encoder's pad_token_id, build a combined
[image ones; text mask] mask, prepend a 1 for the CLS token FLAVATransformerWithoutEmbeddings
adds, and pass it to the multimodal layers.

Reproduction: a classification-style forward over two captions of 6 and 3 tokens padded to 6
(pad_token_id = 0) with 4 image patches each; the multimodal layers call
F.scaled_dot_product_attention.
"""
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, n_head, dim_feedforward):
        super().__init__()
        self.n_head = n_head
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.feedforward = nn.Sequential(nn.Linear(d_model, dim_feedforward), nn.GELU(),
                                         nn.Linear(dim_feedforward, d_model))
        self.attention_layernorm = nn.LayerNorm(d_model)
        self.feedforward_layernorm = nn.LayerNorm(d_model)

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        b, s, d = hidden_states.shape
        x = self.attention_layernorm(hidden_states)
        q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2) for t in self.in_proj(x).chunk(3, dim=-1))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        hidden_states = hidden_states + self.out_proj(attn.transpose(1, 2).reshape(b, s, d))
        return hidden_states + self.feedforward(self.feedforward_layernorm(hidden_states))


class FLAVATransformerWithoutEmbeddings(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, num_hidden_layers, intermediate_size):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden_size))
        self.layers = nn.ModuleList([TransformerEncoderLayer(hidden_size, num_attention_heads, intermediate_size)
                                     for _ in range(num_hidden_layers)])
        self.layernorm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        batch_size = hidden_states.shape[0]
        cls_tokens = self.cls_token.expand(batch_size, -1, -1)
        hidden_states = torch.cat((cls_tokens, hidden_states), dim=1)
        if attention_mask is not None:
            # (B, S) -> (B, 1 + S), the CLS token is always attended; then (B, 1, 1, 1 + S)
            attention_mask = torch.cat([attention_mask.new_ones(batch_size, 1), attention_mask], dim=-1)
            attention_mask = attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.layernorm(hidden_states)


class FLAVAModel(nn.Module):
    def __init__(self, hidden_size=32, pad_token_id=0, vocab_size=128, patch_dim=48):
        super().__init__()
        self.pad_token_id = pad_token_id
        # stand-ins for the (already padding-aware) unimodal encoders' last hidden states
        self.text_embeddings = nn.Embedding(vocab_size, hidden_size, padding_idx=pad_token_id)
        self.patch_embeddings = nn.Linear(patch_dim, hidden_size)
        self.mm_encoder = FLAVATransformerWithoutEmbeddings(hidden_size, 4, 2, 64)
        self.image_to_mm_projection = nn.Linear(hidden_size, hidden_size)
        self.text_to_mm_projection = nn.Linear(hidden_size, hidden_size)

    def forward(self, image: Tensor, text: Tensor) -> Tensor:
        image_hidden = self.patch_embeddings(image)
        text_hidden = self.text_embeddings(text)
        text_pad_mask = text != self.pad_token_id if FIXED else None
        return self.encode_mm(image_hidden, text_hidden, text_pad_mask)

    def encode_mm(self, image_embedding: Tensor, text_embedding: Tensor,
                  text_pad_mask: Optional[Tensor] = None) -> Tensor:
        image_embedding = self.image_to_mm_projection(image_embedding)
        text_embedding = self.text_to_mm_projection(text_embedding)
        fused_state = torch.cat([image_embedding, text_embedding], dim=1)
        if text_pad_mask is None:
            return self.mm_encoder(fused_state)
        image_mask = torch.ones(image_embedding.shape[:2], dtype=torch.bool, device=fused_state.device)
        fused_mask = torch.cat([image_mask, text_pad_mask.bool()], dim=-1)
        return self.mm_encoder(fused_state, attention_mask=fused_mask)


class FLAVAForClassification(nn.Module):
    def __init__(self, model: FLAVAModel, num_classes: int):
        super().__init__()
        self.model = model
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, image: Tensor, text: Tensor, cls_index: int = 0) -> Tensor:
        hidden_state = self.model(image=image, text=text)
        return self.classifier(hidden_state[:, cls_index])


if __name__ == "__main__":
    torch.manual_seed(0)
    clf = FLAVAForClassification(FLAVAModel(), num_classes=3).eval()
    image = torch.randn(2, 4, 48)  # 4 patches per image
    text = torch.tensor([[101, 7, 8, 9, 10, 102],
                         [101, 11, 102, 0, 0, 0]])
    with torch.no_grad():
        logits = clf(image, text)
    print("logits", [[round(v, 4) for v in row] for row in logits.tolist()])
