"""Megatron-Bridge Gemma 4 VL: image-token blocks made bidirectional for checkpoints that are causal.

Citation: NVIDIA-NeMo/Megatron-Bridge#5333 ("[model] fix: honor Gemma 4 image attention mode").
Read from the PR description and the pre-fix modeling_gemma4_vl.py; the exact pre-fix forward()
wiring of the mask is reconstructed from the description ("Their supported forward path still
unconditionally made contiguous image-token blocks bidirectional").

Bug: Gemma4VLModel._compute_attention_mask builds causal OR "same contiguous image block"
(Megatron polarity: True = masked) for every Gemma 4 VL checkpoint. Only the 26B/31B variants set
text_config.use_bidirectional_attention = "vision"; E2B/E4B leave it null and Hugging Face runs
them fully causal, so after import their image tokens saw later image tokens of the same image.
Fix: apply the image-block override only when text_config.use_bidirectional_attention ==
"vision"; otherwise return the plain causal mask.

Reproduction: an E2B-style config (use_bidirectional_attention=None), a two-sample batch holding
a 4-token and a 3-token image span, and a small decoder whose self-attention calls
F.scaled_dot_product_attention with ``attn_mask=~attention_mask``.
"""
import sys
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.linear_qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.linear_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        s, b, h = hidden_states.shape  # Megatron layout [seq, batch, hidden]
        q, k, v = self.linear_qkv(hidden_states).chunk(3, dim=-1)
        q, k, v = (t.view(s, b, self.num_attention_heads, -1).permute(1, 2, 0, 3) for t in (q, k, v))
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, h)
        return self.linear_proj(out)


class GPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        tc = config.text_config
        self.embedding = nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.layers = nn.ModuleList([SelfAttention(tc.hidden_size, tc.num_attention_heads)
                                     for _ in range(tc.num_hidden_layers)])
        self.output_layer = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)

    def forward(self, decoder_input, attention_mask):
        x = decoder_input
        for layer in self.layers:
            x = x + layer(x, attention_mask)
        return self.output_layer(x)


class Gemma4VLModel(nn.Module):
    def __init__(self, config, pre_process=True):
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.embed_vision = nn.Linear(config.vision_config.hidden_size, config.text_config.hidden_size, bias=False)
        self.language_model = GPTModel(config)

    def forward(self, input_ids, pixel_values=None, attention_mask=None):
        inputs_embeds = self.language_model.embedding(input_ids)  # [batch, seq_len, hidden]
        if pixel_values is not None:
            image_features = self.embed_vision(pixel_values)
            special_image_mask = (input_ids == self.config.image_token_id).unsqueeze(-1)
            special_image_mask = special_image_mask.expand_as(inputs_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(special_image_mask, image_features)
        inputs_embeds = inputs_embeds.transpose(1, 0).contiguous()  # (B, T, D) -> (T, B, D)

        if attention_mask is None:
            attention_mask = self._compute_attention_mask(input_ids)
        return self.language_model(decoder_input=inputs_embeds, attention_mask=attention_mask)

    def _compute_attention_mask(self, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Compute attention mask with bidirectional attention for image regions."""
        if not self.pre_process:
            return None
        batch_size, seq_len = input_ids.shape
        causal_mask = torch.tril(torch.ones((batch_size, 1, seq_len, seq_len))).to(input_ids.device)
        if FIXED and getattr(self.config.text_config, "use_bidirectional_attention", None) != "vision":
            return ~causal_mask.bool()

        image_mask = input_ids == self.config.image_token_id
        padded_mask = F.pad(image_mask, (1, 0), value=0)
        boundary = padded_mask[:, 1:] > padded_mask[:, :-1]
        numbered_boundary = torch.cumsum(boundary, dim=-1)
        q_block_indices = image_mask * numbered_boundary
        kv_block_indices = q_block_indices
        bidirectional_mask = torch.logical_and(
            kv_block_indices[:, None, :] == q_block_indices.unsqueeze(-1),
            q_block_indices.unsqueeze(-1) > 0,
        )
        attention_mask = ~torch.logical_or(causal_mask, bidirectional_mask.unsqueeze(1))
        return attention_mask


if __name__ == "__main__":
    torch.manual_seed(0)
    config = SimpleNamespace(
        image_token_id=7,
        # gemma-4-E2B: the text config leaves use_bidirectional_attention null
        text_config=SimpleNamespace(vocab_size=32, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                    use_bidirectional_attention=None),
        vision_config=SimpleNamespace(hidden_size=24),
    )
    model = Gemma4VLModel(config).eval()
    input_ids = torch.tensor([[2, 3, 7, 7, 7, 7, 4, 5, 6],
                              [2, 7, 7, 7, 3, 4, 5, 6, 8]])
    pixel_values = torch.randn(7, 24)  # soft tokens of both images, in order
    with torch.no_grad():
        logits = model(input_ids, pixel_values=pixel_values)
    print("logits", tuple(logits.shape), "first image token %.4f" % logits[2, 0].max().item())
