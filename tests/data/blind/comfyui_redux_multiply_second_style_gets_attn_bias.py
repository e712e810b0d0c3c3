# Comfy-Org/ComfyUI#6737 (commit 832e3f5c, "Fix another small bug in attention_bias redux"),
# following #6721 (commit b6951768). nodes.py StyleModelApply.apply_stylemodel appends the Flux Redux
# image tokens to the text conditioning and, for strength_type "attn_bias", grows the joint
# [txt | img] attention mask of the conditioning with a log(strength) bias on the columns of the new
# tokens. #6721 made the mask grow whenever the conditioning already carried one, but kept
# attn_bias = log(strength) for every strength_type: a second Redux applied with "multiply" on a
# conditioning that already has a mask both scales its tokens and biases them by log(strength).
# The fix: the bias is log(strength) only for "attn_bias", log(1.0) = 0 otherwise.
# Ported (trimmed, tiny sizes, random weights): nodes.py StyleModelApply, comfy/ldm/flux/redux.py,
# comfy/model_base.py Flux.extra_conds, comfy/utils.py upscale_dit_mask,
# comfy/ldm/modules/attention.py attention_pytorch, comfy/ldm/flux/{math,layers,model}.py.
import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- comfy/ldm/modules/attention.py ----
def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = map(lambda t: t.view(b, -1, heads, dim_head).transpose(1, 2), (q, k, v))

    if mask is not None:
        # add a batch dimension if there isn't already one
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        # add a heads dimension if there isn't already one
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)

    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(b, -1, heads * dim_head)
    return out


optimized_attention = attention_pytorch


# ---- comfy/ldm/flux/math.py ----
def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor, mask=None) -> Tensor:
    q_shape = q.shape
    k_shape = k.shape
    q = q.float().reshape(*q.shape[:-1], -1, 1, 2)
    k = k.float().reshape(*k.shape[:-1], -1, 1, 2)
    q = (pe[..., 0] * q[..., 0] + pe[..., 1] * q[..., 1]).reshape(*q_shape).type_as(v)
    k = (pe[..., 0] * k[..., 0] + pe[..., 1] * k[..., 1]).reshape(*k_shape).type_as(v)
    heads = q.shape[1]
    x = optimized_attention(q, k, v, heads, skip_reshape=True, mask=mask)
    return x


def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    assert dim % 2 == 0
    scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64, device=pos.device)
    omega = 1.0 / (theta ** scale)
    out = torch.einsum("...n,d->...nd", pos.to(dtype=torch.float32), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    out = out.reshape(*out.shape[:-1], 2, 2)
    return out.to(dtype=torch.float32, device=pos.device)


# ---- comfy/ldm/flux/layers.py ----
class EmbedND(nn.Module):
    def __init__(self, dim, theta, axes_dim):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.axes_dim = axes_dim

    def forward(self, ids):
        n_axes = ids.shape[-1]
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-3)
        return emb.unsqueeze(1)


def timestep_embedding(t, dim, max_period=10000, time_factor=1000.0):
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim, hidden_dim):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x):
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + 1e-6) * self.scale


class QKNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)


@dataclass
class ModulationOut:
    shift: Tensor
    scale: Tensor
    gate: Tensor


class Modulation(nn.Module):
    def __init__(self, dim, double):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec):
        out = self.lin(nn.functional.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)
        return (ModulationOut(*out[:3]), ModulationOut(*out[3:]) if self.is_double else None)


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio, qkv_bias=False):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = nn.Sequential(nn.Linear(hidden_size, mlp_hidden_dim), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden_dim, hidden_size))
        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = nn.Sequential(nn.Linear(hidden_size, mlp_hidden_dim), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden_dim, hidden_size))

    def forward(self, img, txt, vec, pe, attn_mask=None):
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)

        img_modulated = (1 + img_mod1.scale) * self.img_norm1(img) + img_mod1.shift
        img_qkv = self.img_attn.qkv(img_modulated)
        img_q, img_k, img_v = img_qkv.view(img_qkv.shape[0], img_qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        img_q, img_k = self.img_attn.norm(img_q, img_k, img_v)

        txt_modulated = (1 + txt_mod1.scale) * self.txt_norm1(txt) + txt_mod1.shift
        txt_qkv = self.txt_attn.qkv(txt_modulated)
        txt_q, txt_k, txt_v = txt_qkv.view(txt_qkv.shape[0], txt_qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        txt_q, txt_k = self.txt_attn.norm(txt_q, txt_k, txt_v)

        # run actual attention
        attn = attention(torch.cat((txt_q, img_q), dim=2),
                         torch.cat((txt_k, img_k), dim=2),
                         torch.cat((txt_v, img_v), dim=2),
                         pe=pe, mask=attn_mask)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]

        img = img + img_mod1.gate * self.img_attn.proj(img_attn)
        img = img + img_mod2.gate * self.img_mlp((1 + img_mod2.scale) * self.img_norm2(img) + img_mod2.shift)
        txt = txt + txt_mod1.gate * self.txt_attn.proj(txt_attn)
        txt = txt + txt_mod2.gate * self.txt_mlp((1 + txt_mod2.scale) * self.txt_norm2(txt) + txt_mod2.shift)
        return img, txt


class SingleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x, vec, pe, attn_mask=None):
        mod, _ = self.modulation(vec)
        qkv, mlp = torch.split(self.linear1((1 + mod.scale) * self.pre_norm(x) + mod.shift), [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe=pe, mask=attn_mask)
        output = self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
        return x + mod.gate * output


class LastLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, vec):
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        x = (1 + scale[:, None, :]) * self.norm_final(x) + shift[:, None, :]
        return self.linear(x)


# ---- comfy/ldm/flux/model.py ----
@dataclass
class FluxParams:
    in_channels: int = 16
    out_channels: int = 16
    vec_in_dim: int = 8
    context_in_dim: int = 24
    hidden_size: int = 32
    mlp_ratio: float = 4.0
    num_heads: int = 2
    depth: int = 2
    depth_single_blocks: int = 2
    axes_dim: tuple = (4, 6, 6)
    theta: int = 10000
    qkv_bias: bool = True
    guidance_embed: bool = False
    patch_size: int = 2


class Flux(nn.Module):
    def __init__(self, params: FluxParams):
        super().__init__()
        self.params = params
        self.patch_size = params.patch_size
        self.num_heads = params.num_heads
        self.pe_embedder = EmbedND(dim=params.hidden_size // params.num_heads, theta=params.theta, axes_dim=list(params.axes_dim))
        self.img_in = nn.Linear(params.in_channels, params.hidden_size, bias=True)
        self.time_in = MLPEmbedder(256, params.hidden_size)
        self.vector_in = MLPEmbedder(params.vec_in_dim, params.hidden_size)
        self.txt_in = nn.Linear(params.context_in_dim, params.hidden_size)
        self.double_blocks = nn.ModuleList([DoubleStreamBlock(params.hidden_size, params.num_heads, params.mlp_ratio, params.qkv_bias) for _ in range(params.depth)])
        self.single_blocks = nn.ModuleList([SingleStreamBlock(params.hidden_size, params.num_heads, params.mlp_ratio) for _ in range(params.depth_single_blocks)])
        self.final_layer = LastLayer(params.hidden_size, 1, params.out_channels)

    def forward_orig(self, img, img_ids, txt, txt_ids, timesteps, y, attn_mask=None):
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256).to(img.dtype))
        vec = vec + self.vector_in(y[:, :self.params.vec_in_dim])
        txt = self.txt_in(txt)

        ids = torch.cat((txt_ids, img_ids), dim=1)
        pe = self.pe_embedder(ids)

        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask)

        img = torch.cat((txt, img), 1)
        for block in self.single_blocks:
            img = block(img, vec=vec, pe=pe, attn_mask=attn_mask)

        img = img[:, txt.shape[1]:, ...]
        img = self.final_layer(img, vec)
        return img

    def forward(self, x, timestep, context, y, **kwargs):
        bs, c, h, w = x.shape
        ps = self.patch_size
        h_len, w_len = h // ps, w // ps
        # rearrange(x, "b c (h ph) (w pw) -> b (h w) (c ph pw)")
        img = x.reshape(bs, c, h_len, ps, w_len, ps).permute(0, 2, 4, 1, 3, 5).reshape(bs, h_len * w_len, c * ps * ps)
        img_ids = torch.zeros((h_len, w_len, 3), dtype=x.dtype)
        img_ids[:, :, 1] = img_ids[:, :, 1] + torch.linspace(0, h_len - 1, steps=h_len, dtype=x.dtype).unsqueeze(1)
        img_ids[:, :, 2] = img_ids[:, :, 2] + torch.linspace(0, w_len - 1, steps=w_len, dtype=x.dtype).unsqueeze(0)
        img_ids = img_ids.reshape(1, h_len * w_len, 3).repeat(bs, 1, 1)
        txt_ids = torch.zeros((bs, context.shape[1], 3), dtype=x.dtype)
        out = self.forward_orig(img, img_ids, context, txt_ids, timestep, y, attn_mask=kwargs.get("attention_mask", None))
        return out.reshape(bs, h_len, w_len, c, ps, ps).permute(0, 3, 1, 4, 2, 5).reshape(bs, c, h, w)


# ---- comfy/utils.py ----
def upscale_dit_mask(mask, img_size_in, img_size_out):
    hi, wi = img_size_in
    ho, wo = img_size_out
    if (hi, wi) == (ho, wo):
        return mask
    if mask.ndim == 2:
        mask = mask.unsqueeze(0)
    interpolate = torch.nn.functional.interpolate
    b = mask.shape[0]
    txt_tokens = mask.shape[1] - (hi * wi)
    txt_to_txt = mask[:, :txt_tokens, :txt_tokens]
    txt_to_img = mask[:, :txt_tokens, txt_tokens:]
    img_to_img = mask[:, txt_tokens:, txt_tokens:]
    img_to_txt = mask[:, txt_tokens:, :txt_tokens]

    txt_to_img = txt_to_img.reshape(b, txt_tokens, hi, wi)
    txt_to_img = interpolate(txt_to_img, size=img_size_out, mode="bilinear").reshape(b, txt_tokens, ho * wo)
    img_to_img = img_to_img.reshape(b, hi * wi, hi, wi)
    img_to_img = interpolate(img_to_img, size=img_size_out, mode="bilinear")  # b (hk wk) hq wq
    img_to_img = img_to_img.reshape(b, hi, wi, ho * wo).permute(0, 3, 1, 2)   # b (hq wq) hk wk
    img_to_img = interpolate(img_to_img, size=img_size_out, mode="bilinear")  # b (hq wq) hk wk
    img_to_img = img_to_img.reshape(b, ho * wo, ho * wo).transpose(1, 2)      # b (hk wk) (hq wq)
    img_to_txt = img_to_txt.permute(0, 2, 1).reshape(b, txt_tokens, hi, wi)
    img_to_txt = interpolate(img_to_txt, size=img_size_out, mode="bilinear").reshape(b, txt_tokens, ho * wo).permute(0, 2, 1)

    return torch.cat([torch.cat([txt_to_txt, txt_to_img], dim=2),
                      torch.cat([img_to_txt, img_to_img], dim=2)], dim=1)


# ---- comfy/model_base.py Flux.extra_conds (attention_mask part) ----
def flux_extra_conds(diffusion_model, noise, attention_mask=None, attention_mask_img_shape=None, **kwargs):
    out = {}
    if attention_mask is not None:
        shape = noise.shape
        mask_ref_size = attention_mask_img_shape
        # the model will pad to the patch size, and then divide
        (h_tok, w_tok) = (math.ceil(shape[2] / diffusion_model.patch_size), math.ceil(shape[3] / diffusion_model.patch_size))
        attention_mask = upscale_dit_mask(attention_mask, mask_ref_size, (h_tok, w_tok))
        out['attention_mask'] = attention_mask
    return out


# ---- comfy/ldm/flux/redux.py + comfy/sd.py StyleModel ----
class ReduxImageEncoder(nn.Module):
    def __init__(self, redux_dim=12, txt_in_features=24):
        super().__init__()
        self.redux_dim = redux_dim
        self.redux_up = nn.Linear(redux_dim, txt_in_features * 3)
        self.redux_down = nn.Linear(txt_in_features * 3, txt_in_features)

    def forward(self, sigclip_embeds):
        return self.redux_down(torch.nn.functional.silu(self.redux_up(sigclip_embeds)))


class StyleModel:
    def __init__(self, model):
        self.model = model

    def get_cond(self, input):
        return self.model(input["last_hidden_state"])


# ---- nodes.py StyleModelApply ----
class StyleModelApply:
    def apply_stylemodel(self, conditioning, style_model, clip_vision_output, strength, strength_type):
        cond = style_model.get_cond(clip_vision_output).flatten(start_dim=0, end_dim=1).unsqueeze(dim=0)
        if strength_type == "multiply":
            cond *= strength

        n = cond.shape[1]
        c_out = []
        for t in conditioning:
            (txt, keys) = t
            keys = keys.copy()
            # even if the strength is 1.0 (i.e, no change), if there's already a mask, we have to add to it
            if "attention_mask" in keys or (strength_type == "attn_bias" and strength != 1.0):
                # math.log raises an error if the argument is zero
                # torch.log returns -inf, which is what we want
                if FIXED:
                    attn_bias = torch.log(torch.Tensor([strength if strength_type == "attn_bias" else 1.0]))
                else:
                    attn_bias = torch.log(torch.Tensor([strength]))
                # get the size of the mask image
                mask_ref_size = keys.get("attention_mask_img_shape", (1, 1))
                n_ref = mask_ref_size[0] * mask_ref_size[1]
                n_txt = txt.shape[1]
                # grab the existing mask
                mask = keys.get("attention_mask", None)
                # create a default mask if it doesn't exist
                if mask is None:
                    mask = torch.zeros((txt.shape[0], n_txt + n_ref, n_txt + n_ref), dtype=torch.float16)
                # convert the mask dtype, because it might be boolean
                # we want it to be interpreted as a bias
                if mask.dtype == torch.bool:
                    # log(True) = log(1) = 0
                    # log(False) = log(0) = -inf
                    mask = torch.log(mask.to(dtype=torch.float16))
                # now we make the mask bigger to add space for our new tokens
                new_mask = torch.zeros((txt.shape[0], n_txt + n + n_ref, n_txt + n + n_ref), dtype=torch.float16)
                # copy over the old mask, in quandrants
                new_mask[:, :n_txt, :n_txt] = mask[:, :n_txt, :n_txt]
                new_mask[:, :n_txt, n_txt + n:] = mask[:, :n_txt, n_txt:]
                new_mask[:, n_txt + n:, :n_txt] = mask[:, n_txt:, :n_txt]
                new_mask[:, n_txt + n:, n_txt + n:] = mask[:, n_txt:, n_txt:]
                # now fill in the attention bias to our redux tokens
                new_mask[:, :n_txt, n_txt:n_txt + n] = attn_bias
                new_mask[:, n_txt + n:, n_txt:n_txt + n] = attn_bias
                keys["attention_mask"] = new_mask.to(txt.device)
                keys["attention_mask_img_shape"] = mask_ref_size

            c_out.append([torch.cat((txt, cond), dim=1), keys])

        return (c_out,)


def main():
    params = FluxParams()
    diffusion_model = Flux(params).eval()
    style_model = StyleModel(ReduxImageEncoder(redux_dim=12, txt_in_features=params.context_in_dim).eval())

    # CLIPTextEncode output: T5 tokens (context) + pooled CLIP (y)
    txt = torch.randn(1, 6, params.context_in_dim)
    pooled = torch.randn(1, params.vec_in_dim)
    conditioning = [[txt, {"pooled_output": pooled}]]

    # two reference images through SigCLIP (4 tokens each)
    vision_a = {"last_hidden_state": torch.randn(1, 4, 12)}
    vision_b = {"last_hidden_state": torch.randn(1, 4, 12)}

    node = StyleModelApply()
    with torch.no_grad():
        # first Redux: attention bias, strength 0.5
        (conditioning,) = node.apply_stylemodel(conditioning, style_model, vision_a, 0.5, "attn_bias")
        # second Redux: multiply, strength 0.5
        (conditioning,) = node.apply_stylemodel(conditioning, style_model, vision_b, 0.5, "multiply")

        context, keys = conditioning[0]
        # latent 4 channels, 8x8 -> 4x4 tokens of 16 features
        noise = torch.randn(1, 4, 8, 8)
        extra = flux_extra_conds(diffusion_model, noise, **keys)
        # BaseModel._apply_model casts the float conds to the model dtype
        extra = {k: v.to(noise.dtype) for k, v in extra.items()}

        # a short Euler flow-matching sampler
        x = noise
        sigmas = torch.linspace(1.0, 0.0, 5)
        for i in range(len(sigmas) - 1):
            s = sigmas[i].reshape(1)
            v = diffusion_model(x, s, context, keys["pooled_output"], **extra)
            x = x + (sigmas[i + 1] - sigmas[i]) * v

    print("context tokens:", context.shape[1], "mask:", tuple(extra["attention_mask"].shape))
    print("latent out mean %.6f  norm %.6f" % (x.mean().item(), x.norm().item()))


if __name__ == "__main__":
    main()
