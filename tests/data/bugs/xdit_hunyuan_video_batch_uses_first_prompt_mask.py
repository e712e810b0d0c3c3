# xdit-project/xDiT#546: the HunyuanVideo USP forward slices the text tokens of the whole batch with
# encoder_attention_mask[0], so a longer second prompt is cut off (and a shorter one keeps its padding).
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

DIM, HEADS, LAYERS = 32, 4, 2


class HunyuanVideoTransformerBlock(nn.Module):
    """Dual-stream block: image and text tokens keep their own projections, attend jointly."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.img_qkv = nn.Linear(dim, 3 * dim)
        self.txt_qkv = nn.Linear(dim, 3 * dim)
        self.img_out = nn.Linear(dim, dim)
        self.txt_out = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        B, Ni, D = hidden_states.shape
        Nt = encoder_hidden_states.shape[1]
        qkv = torch.cat([self.img_qkv(hidden_states), self.txt_qkv(encoder_hidden_states)], dim=1)
        q, k, v = qkv.view(B, Ni + Nt, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(B, Ni + Nt, D)
        return hidden_states + self.img_out(out[:, :Ni]), encoder_hidden_states + self.txt_out(out[:, Ni:])


class HunyuanVideoTransformer3DModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.x_embedder = nn.Linear(8, DIM)
        self.context_embedder = nn.Linear(16, DIM)
        self.transformer_blocks = nn.ModuleList(HunyuanVideoTransformerBlock(DIM, HEADS) for _ in range(LAYERS))
        self.proj_out = nn.Linear(DIM, 8)

    def forward(self, latents, encoder_hidden_states, encoder_attention_mask):
        hidden_states = self.x_embedder(latents)
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)
        Ni = hidden_states.shape[1]
        attention_mask = None
        if not FIXED:
            # xfuser USP forward: drop padded text tokens using the first prompt's mask for all of the batch
            encoder_attention_mask = encoder_attention_mask[0].to(torch.bool)
            encoder_hidden_states_indices = torch.arange(encoder_hidden_states.shape[1])
            encoder_hidden_states_indices = encoder_hidden_states_indices[encoder_attention_mask]
            encoder_hidden_states = encoder_hidden_states[..., encoder_hidden_states_indices, :]
        else:
            # keep the padded text and give every sample its own key mask over [image, text]
            B = hidden_states.shape[0]
            img_mask = torch.ones(B, Ni, dtype=torch.bool)
            attention_mask = torch.cat([img_mask, encoder_attention_mask.bool()], dim=1)[:, None, None, :]
        for block in self.transformer_blocks:
            hidden_states, encoder_hidden_states = block(hidden_states, encoder_hidden_states, attention_mask)
        return self.proj_out(hidden_states)


def main():
    model = HunyuanVideoTransformer3DModel().eval()
    frames, h, w = 2, 2, 3
    latents = torch.randn(2, frames * h * w, 8)  # (batch, t*h*w patches, channels)
    max_len = 10
    prompt_lens = [4, 9]  # e.g. negative prompt and positive prompt batched for CFG
    prompt_embeds = torch.randn(2, max_len, 16)
    prompt_mask = torch.zeros(2, max_len, dtype=torch.long)
    for i, n in enumerate(prompt_lens):
        prompt_mask[i, :n] = 1
    with torch.no_grad():
        out = model(latents, prompt_embeds, prompt_mask)
        # reference: each prompt run alone, without its padding
        ref = []
        for i, n in enumerate(prompt_lens):
            ref.append(model(latents[i:i + 1], prompt_embeds[i:i + 1, :n], prompt_mask[i:i + 1, :n]))
        ref = torch.cat(ref)
    print(f"{'fixed' if FIXED else 'buggy'}: max |batched - per-prompt| = {(out - ref).abs().max().item():.4e}")


if __name__ == "__main__":
    main()
