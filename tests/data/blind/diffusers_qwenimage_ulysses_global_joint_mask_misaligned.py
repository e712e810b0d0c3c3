# huggingface/diffusers#13756 (commit 86dab152ea, "Fix the QwenImage Attention mask under Ulysses SP";
# issue #13696).
#
# QwenImageTransformer2DModel.forward built one joint attention mask for the whole sequence,
# [encoder_hidden_states_mask, ones for the image tokens], and handed it to every block as
# attention_kwargs["attention_mask"].  Under Ulysses context parallelism the _cp_plan splits the text
# and the image streams along the sequence on each rank, each rank concatenates its own
# [text shard, image shard], and the all-to-all in TemplatedUlyssesAttention lays the keys out as
# [txt_0, img_0, txt_1, img_1, ...].  The global mask [txt, img] was used as it was on that layout, so
# it masked real image tokens and let padded text tokens through.
# The fix passes encoder_hidden_states_mask down (split by the _cp_plan like the streams), has
# QwenDoubleStreamAttnProcessor2_0 build the local joint mask, and all-gathers a local mask in
# TemplatedUlyssesAttention so its layout matches the keys after the all-to-all.
#
# Two Ulysses ranks are run in lockstep in one process: the collectives (all_to_all_single,
# all_gather) are plain-torch stand-ins over the list of the ranks' tensors.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# ---------------------------------------------------------------- collectives over simulated ranks
def _all_to_all_single(xs):
    # xs[r]: rank r's tensor, leading dim world_size; chunk s goes to rank s.
    world_size = len(xs)
    return [torch.stack([xs[s][r] for s in range(world_size)]) for r in range(world_size)]


def _all_gather(xs):
    return [[x.clone() for x in xs] for _ in xs]


# ---------------------------------------------------------------- attention_dispatch.py
def _native_attention_forward_op(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    out = F.scaled_dot_product_attention(
        query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    return out.permute(0, 2, 1, 3)


def templated_ulysses_attention(queries, keys, values, attn_masks, world_size):
    """TemplatedUlyssesAttention.forward, each argument a list over the ranks."""
    B, S_Q_LOCAL, H, D = queries[0].shape
    _, S_KV_LOCAL, _, _ = keys[0].shape
    H_LOCAL = H // world_size

    def scatter_heads(x, S):
        return x.reshape(B, S, world_size, H_LOCAL, D).permute(2, 1, 0, 3, 4).contiguous()

    queries = _all_to_all_single([scatter_heads(q, S_Q_LOCAL) for q in queries])
    keys = _all_to_all_single([scatter_heads(k, S_KV_LOCAL) for k in keys])
    values = _all_to_all_single([scatter_heads(v, S_KV_LOCAL) for v in values])
    queries, keys, values = (
        [x.flatten(0, 1).permute(1, 0, 2, 3).contiguous() for x in xs] for xs in (queries, keys, values)
    )

    if FIXED and attn_masks[0] is not None and attn_masks[0].shape[-1] == S_KV_LOCAL:
        # All-gather a local mask so its layout matches the QKV layout after all-to-all.
        gathered = _all_gather(attn_masks)
        attn_masks = [torch.cat(mask_list, dim=-1) for mask_list in gathered]

    outs = [
        _native_attention_forward_op(q, k, v, attn_mask=m, dropout_p=0.0, is_causal=False)
        for q, k, v, m in zip(queries, keys, values, attn_masks)
    ]

    outs = [o.reshape(B, world_size, S_Q_LOCAL, H_LOCAL, D).permute(1, 3, 0, 2, 4).contiguous() for o in outs]
    outs = _all_to_all_single(outs)
    return [o.flatten(0, 1).permute(1, 2, 0, 3).contiguous() for o in outs]


# ---------------------------------------------------------------- transformer_qwenimage.py (trimmed)
class Attention(nn.Module):
    def __init__(self, dim, heads, head_dim):
        super().__init__()
        self.heads = heads
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.to_add_out = nn.Linear(inner, dim)


class QwenDoubleStreamAttnProcessor2_0:
    def __init__(self, world_size):
        self.world_size = world_size

    def __call__(self, attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask=None, attention_mask=None):
        # every argument is a list over the Ulysses ranks (each rank holds its own sequence shard)
        world_size = self.world_size
        if FIXED:
            if attention_mask is not None:
                raise ValueError("QwenDoubleStreamAttnProcessor2_0 does not accept an external attention_mask.")
            if encoder_hidden_states_mask is not None:
                attention_mask = []
                for r in range(world_size):
                    hs, mask = hidden_states[r], encoder_hidden_states_mask[r]
                    image_mask = torch.ones((hs.shape[0], hs.shape[1]), dtype=torch.bool, device=hs.device)
                    local = torch.cat([mask, image_mask], dim=1)
                    attention_mask.append(local[:, None, None, :])
        if attention_mask is None or isinstance(attention_mask, torch.Tensor):
            attention_mask = [attention_mask] * world_size

        seq_txt = encoder_hidden_states[0].shape[1]
        joint_q, joint_k, joint_v = [], [], []
        for r in range(world_size):
            img_query = attn.to_q(hidden_states[r]).unflatten(-1, (attn.heads, -1))
            img_key = attn.to_k(hidden_states[r]).unflatten(-1, (attn.heads, -1))
            img_value = attn.to_v(hidden_states[r]).unflatten(-1, (attn.heads, -1))
            txt_query = attn.add_q_proj(encoder_hidden_states[r]).unflatten(-1, (attn.heads, -1))
            txt_key = attn.add_k_proj(encoder_hidden_states[r]).unflatten(-1, (attn.heads, -1))
            txt_value = attn.add_v_proj(encoder_hidden_states[r]).unflatten(-1, (attn.heads, -1))
            # Order: [text, image]
            joint_q.append(torch.cat([txt_query, img_query], dim=1))
            joint_k.append(torch.cat([txt_key, img_key], dim=1))
            joint_v.append(torch.cat([txt_value, img_value], dim=1))

        joint_hidden_states = templated_ulysses_attention(joint_q, joint_k, joint_v, attention_mask, world_size)

        img_out, txt_out = [], []
        for r in range(world_size):
            jhs = joint_hidden_states[r].flatten(2, 3)
            txt_attn_output = jhs[:, :seq_txt, :]
            img_attn_output = jhs[:, seq_txt:, :]
            img_out.append(attn.to_out[0](img_attn_output.contiguous()))
            txt_out.append(attn.to_add_out(txt_attn_output.contiguous()))
        return img_out, txt_out


class QwenImageTransformerBlock(nn.Module):
    def __init__(self, dim, heads, head_dim, world_size):
        super().__init__()
        self.attn = Attention(dim, heads, head_dim)
        self.processor = QwenDoubleStreamAttnProcessor2_0(world_size)
        self.img_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.txt_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, joint_attention_kwargs):
        joint_attention_kwargs = joint_attention_kwargs or {}
        img_attn, txt_attn = self.processor(
            self.attn,
            hidden_states,
            encoder_hidden_states,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            **joint_attention_kwargs,
        )
        hidden_states = [h + a for h, a in zip(hidden_states, img_attn)]
        encoder_hidden_states = [e + a for e, a in zip(encoder_hidden_states, txt_attn)]
        hidden_states = [h + self.img_mlp(h) for h in hidden_states]
        encoder_hidden_states = [e + self.txt_mlp(e) for e in encoder_hidden_states]
        return encoder_hidden_states, hidden_states


class QwenImageTransformer2DModel(nn.Module):
    def __init__(self, in_channels=8, joint_attention_dim=16, dim=32, heads=4, head_dim=8, num_layers=2, ulysses_degree=2):
        super().__init__()
        self.ulysses_degree = ulysses_degree
        self.img_in = nn.Linear(in_channels, dim)
        self.txt_in = nn.Linear(joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            [QwenImageTransformerBlock(dim, heads, head_dim, ulysses_degree) for _ in range(num_layers)]
        )
        self.proj_out = nn.Linear(dim, in_channels)

    def _cp_split(self, x):
        # ContextParallelInput(split_dim=1): each rank keeps its own shard of the sequence
        return list(x.chunk(self.ulysses_degree, dim=1))

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_kwargs=None):
        hidden_states = self.img_in(hidden_states)
        encoder_hidden_states = self.txt_in(encoder_hidden_states)

        block_attention_kwargs = attention_kwargs.copy() if attention_kwargs is not None else {}
        if not FIXED and encoder_hidden_states_mask is not None:
            # Construct joint attention mask once to avoid reconstructing in every block
            batch_size, image_seq_len = hidden_states.shape[:2]
            image_mask = torch.ones((batch_size, image_seq_len), dtype=torch.bool, device=hidden_states.device)
            joint_attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
            joint_attention_mask = joint_attention_mask[:, None, None, :]
            block_attention_kwargs["attention_mask"] = joint_attention_mask

        # _cp_plan: "transformer_blocks.0" splits hidden_states / encoder_hidden_states,
        # and (after the fix) "transformer_blocks.*" splits encoder_hidden_states_mask
        hidden_states = self._cp_split(hidden_states)
        encoder_hidden_states = self._cp_split(encoder_hidden_states)
        block_mask = self._cp_split(encoder_hidden_states_mask) if FIXED else None

        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=block_mask,
                joint_attention_kwargs=block_attention_kwargs,
            )

        # proj_out: ContextParallelOutput(gather_dim=1)
        return self.proj_out(torch.cat(hidden_states, dim=1))


def main():
    model = QwenImageTransformer2DModel().eval()
    batch, txt_len, img_len = 2, 8, 4
    prompt_lens = torch.tensor([3, 8])
    encoder_hidden_states_mask = torch.arange(txt_len)[None, :] < prompt_lens[:, None]  # right-padded prompts
    encoder_hidden_states = torch.randn(batch, txt_len, 16)
    encoder_hidden_states = encoder_hidden_states * encoder_hidden_states_mask[..., None]
    latents = torch.randn(batch, img_len, 8)

    with torch.no_grad():
        noise_pred = model(latents, encoder_hidden_states, encoder_hidden_states_mask)
    print("fixed" if FIXED else "buggy", "noise_pred", tuple(noise_pred.shape))
    for b in range(batch):
        print(f"  sample {b}: mean {noise_pred[b].mean().item():+.5f}  norm {noise_pred[b].norm().item():.5f}")


if __name__ == "__main__":
    main()
