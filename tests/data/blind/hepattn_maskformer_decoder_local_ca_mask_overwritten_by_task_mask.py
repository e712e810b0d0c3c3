# hepattn (samvanstroud/hepattn#145, commit c83aca6 "bug fix where local_ca mask was being overwritten by task masks"):
# MaskFormerDecoder.forward reused the name `attn_mask` as the loop variable over the tasks' attention masks, so the
# local strided cross-attention mask built before the layer loop is replaced by the last task's hit mask.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


# hepattn/utils/local_ca.py
def get_local_ca_mask(n_objects, n_inputs, window_size, stride=1, device=None, wrap=False):
    assert window_size >= 0, "Window size must be non-negative"
    assert window_size % 2 == 0, "Window size must be even"
    mask = torch.zeros((n_objects, n_inputs), dtype=torch.bool, device=device)
    for i in range(n_objects):
        start_raw = round(i * stride) - window_size // 2
        start = max(0, start_raw)
        end_raw = round(i * stride) + window_size // 2 + 1
        end = min(n_inputs, end_raw)
        mask[i, start:end] = 1
        if wrap:
            if start_raw < 0:
                mask[i, n_inputs + start_raw:n_inputs] = 1
            if end_raw > n_inputs:
                mask[i, 0:end_raw - n_inputs] = 1
    return mask


def auto_local_ca_mask(q, kv, window_size, wrap=True):
    n_objects = q.shape[1]
    n_inputs = kv.shape[1]
    stride = n_inputs / n_objects
    mask = get_local_ca_mask(n_objects, n_inputs, window_size, stride, q.device, wrap)
    assert not (~mask.any(dim=0)).any(), "Some columns are all False, increase window size"
    return mask.unsqueeze(0)


# hepattn/utils/model_utils.py
def unmerge_inputs(x, input_names):
    batch_size = x["key_embed"].shape[0]
    dim = x["key_embed"].shape[-1]
    for input_name in input_names:
        x[f"{input_name}_embed"] = x["key_embed"][x[f"key_is_{input_name}"]].view(batch_size, -1, dim)
    return x


class Dense(nn.Module):
    def __init__(self, dim, out=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, out or dim))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    """hepattn Attention, torch backend: q/kv padding masks merged with attn_mask, True = attend."""

    def __init__(self, dim, num_heads=2):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, q, kv=None, attn_mask=None, q_mask=None, kv_mask=None):
        kv = q if kv is None else kv
        b, s, d = q.shape
        h = self.num_heads
        qh = self.q_proj(q).view(b, s, h, -1).transpose(1, 2)
        kh = self.k_proj(kv).view(b, kv.shape[1], h, -1).transpose(1, 2)
        vh = self.v_proj(kv).view(b, kv.shape[1], h, -1).transpose(1, 2)
        merged = None
        if q_mask is not None or kv_mask is not None:
            q_mask = torch.full(q.shape[:-1], True) if q_mask is None else q_mask
            kv_mask = torch.full(kv.shape[:-1], True) if kv_mask is None else kv_mask
            merged = q_mask.unsqueeze(-1) & kv_mask.unsqueeze(-2)
        if attn_mask is not None:
            merged = attn_mask & merged if merged is not None else attn_mask
        if merged is not None and merged.dim() == 3:
            merged = merged.unsqueeze(-3)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=merged)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class Residual(nn.Module):
    def __init__(self, fn, dim, norm="LayerNorm"):
        super().__init__()
        self.fn, self.norm = fn, nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        return x + self.fn(self.norm(x), **kwargs)


class ObjectHitMaskTask(nn.Module):
    """hepattn/models/task.py ObjectHitMaskTask (trimmed to forward + attn_mask)."""

    def __init__(self, name, input_constituent, input_object, output_object, dim, mask_attn=True, logit_scale=1.0):
        super().__init__()
        self.name = name
        self.input_constituent = input_constituent
        self.input_object = input_object
        self.mask_attn = mask_attn
        self.logit_scale = logit_scale
        self.has_intermediate_loss = mask_attn
        self.output_object_hit = output_object + "_" + input_constituent
        self.outputs = [self.output_object_hit + "_logit"]
        self.hit_net = Dense(dim, dim)
        self.object_net = Dense(dim, dim)

    def forward(self, x):
        x_object = self.object_net(x[self.input_object + "_embed"])
        x_hit = self.hit_net(x[self.input_constituent + "_embed"])
        object_hit_logit = self.logit_scale * torch.einsum("bnc,bmc->bnm", x_object, x_hit)
        object_hit_logit[~x[self.input_constituent + "_valid"].unsqueeze(-2).expand_as(object_hit_logit)] = torch.finfo(object_hit_logit.dtype).min
        return {self.output_object_hit + "_logit": object_hit_logit}

    def attn_mask(self, outputs, threshold=0.1):
        if not self.mask_attn:
            return {}
        attn_mask = outputs[self.output_object_hit + "_logit"].detach().sigmoid() >= threshold
        attn_mask[torch.where(torch.all(attn_mask, dim=-1))] = False
        return {self.input_constituent: attn_mask}


class MaskFormerDecoderLayer(nn.Module):
    def __init__(self, dim, mask_attention=True, bidirectional_ca=True):
        super().__init__()
        self.mask_attention = mask_attention
        self.bidirectional_ca = bidirectional_ca
        residual = partial(Residual, dim=dim)
        self.q_ca = residual(Attention(dim))
        self.q_sa = residual(Attention(dim))
        self.q_dense = residual(Dense(dim))
        self.kv_ca = residual(Attention(dim))
        self.kv_dense = residual(Dense(dim))

    def forward(self, q, kv, attn_mask=None, q_mask=None, kv_mask=None):
        if self.mask_attention:
            assert attn_mask is not None, "attn_mask must be provided for mask attention"
            attn_mask = attn_mask.detach()
            attn_mask = torch.where(torch.all(~attn_mask, dim=-1, keepdim=True), True, attn_mask)
        else:
            attn_mask = None
        q = self.q_ca(q, kv=kv, attn_mask=attn_mask, q_mask=q_mask, kv_mask=kv_mask)
        q = self.q_sa(q, q_mask=q_mask)
        q = self.q_dense(q)
        if self.bidirectional_ca:
            if attn_mask is not None:
                attn_mask = attn_mask.transpose(-2, -1)
            kv = self.kv_ca(kv, kv=q, attn_mask=attn_mask, q_mask=kv_mask, kv_mask=q_mask)
            kv = self.kv_dense(kv)
        return q, kv


class MaskFormerDecoder(nn.Module):
    def __init__(self, num_queries, dim, num_decoder_layers, mask_attention=True, local_strided_attn=False,
                 window_size=512, window_wrap=True):
        super().__init__()
        self.decoder_layers = nn.ModuleList([MaskFormerDecoderLayer(dim, mask_attention=mask_attention)
                                             for _ in range(num_decoder_layers)])
        self.tasks = None
        self.num_queries = num_queries
        self.mask_attention = mask_attention
        self.use_query_masks = False
        self.local_strided_attn = local_strided_attn
        self.window_size = window_size
        self.window_wrap = window_wrap
        self.initial_queries = nn.Parameter(torch.randn(num_queries, dim))
        assert not (self.local_strided_attn and self.mask_attention), "local_strided_attn and mask_attention cannot both be True"

    def forward(self, x, input_names):
        batch_size = x["key_embed"].shape[0]
        num_constituents = x["key_embed"].shape[-2]
        x["query_embed"] = self.initial_queries.expand(batch_size, -1, -1)
        x["query_valid"] = torch.full((batch_size, self.num_queries), True)

        attn_mask = None
        if self.local_strided_attn:
            assert x["query_embed"].shape[0] == 1, "Local strided attention only supports batch size 1"
            attn_mask = auto_local_ca_mask(x["query_embed"], x["key_embed"], self.window_size, wrap=self.window_wrap)

        outputs = {}
        for layer_index, decoder_layer in enumerate(self.decoder_layers):
            outputs[f"layer_{layer_index}"] = {}
            attn_masks = {}
            for task in self.tasks:
                if not task.has_intermediate_loss:
                    continue
                task_outputs = task(x)
                outputs[f"layer_{layer_index}"][task.name] = task_outputs

                # Collect attention masks from different tasks
                task_attn_masks = task.attn_mask(task_outputs)
                if not FIXED:
                    for input_name, attn_mask in task_attn_masks.items():
                        if input_name in attn_masks:
                            attn_masks[input_name] |= attn_mask
                        else:
                            attn_masks[input_name] = attn_mask
                else:
                    for input_name, task_attn_mask in task_attn_masks.items():
                        if input_name in attn_masks:
                            attn_masks[input_name] |= task_attn_mask
                        else:
                            attn_masks[input_name] = task_attn_mask

            # Construct the full attention mask for MaskAttention decoder
            if attn_masks and self.mask_attention:
                attn_mask = torch.full((batch_size, self.num_queries, num_constituents), False)
                for input_name, task_attn_mask in attn_masks.items():
                    attn_mask[x[f"key_is_{input_name}"].unsqueeze(1).expand_as(attn_mask)] = task_attn_mask.flatten()

            if attn_mask is not None:
                outputs[f"layer_{layer_index}"]["attn_mask"] = attn_mask

            x["query_embed"], x["key_embed"] = decoder_layer(
                x["query_embed"], x["key_embed"], attn_mask=attn_mask,
                q_mask=x.get("query_mask"), kv_mask=x.get("key_valid"))
            x = unmerge_inputs(x, input_names)
        return x, outputs


def main():
    torch.manual_seed(0)
    dim, num_queries, n_pix, n_strip = 32, 6, 16, 8
    input_names = ["pix", "strip"]
    decoder = MaskFormerDecoder(num_queries, dim, num_decoder_layers=2, mask_attention=False,
                                local_strided_attn=True, window_size=6)
    decoder.tasks = nn.ModuleList([ObjectHitMaskTask("track_pix", "pix", "query", "track", dim, mask_attn=True)])

    x = {"pix_embed": torch.randn(1, n_pix, dim), "strip_embed": torch.randn(1, n_strip, dim),
         "pix_valid": torch.ones(1, n_pix, dtype=torch.bool), "strip_valid": torch.ones(1, n_strip, dtype=torch.bool)}
    x["key_embed"] = torch.cat([x["pix_embed"], x["strip_embed"]], dim=-2)
    x["key_valid"] = torch.cat([x["pix_valid"], x["strip_valid"]], dim=-1)
    x["key_is_pix"] = torch.cat([torch.ones(1, n_pix, dtype=torch.bool), torch.zeros(1, n_strip, dtype=torch.bool)], dim=-1)
    x["key_is_strip"] = ~x["key_is_pix"]

    local_ca = auto_local_ca_mask(torch.zeros(1, num_queries, dim), x["key_embed"], 6, wrap=True)
    with torch.no_grad():
        _, outputs = decoder(x, input_names)

    wrong = 0
    for layer in outputs:
        m = outputs[layer]["attn_mask"]
        if m.shape != local_ca.shape:
            # a per-input task mask: scatter it back onto the merged key axis, as the decoder would
            full = torch.zeros_like(local_ca)
            full[x["key_is_pix"].unsqueeze(1).expand_as(full)] = m.flatten()
            m = full
        wrong += int((m != local_ca).sum())
    print(f"decoder attn_mask entries differing from the local strided CA mask (all layers): {wrong} "
          f"of {local_ca.numel() * len(outputs)}")


if __name__ == "__main__":
    main()
