# Follows VectorSpaceLab/OmniGen (diffusers pipelines/omnigen/processor_omnigen.py) OmniGenCollator.pad_input_ids / create_position /
# create_mask / adjust_attention_for_input_images: LEFT-padded prompt (pad rows all ones, pad columns zero), causal text, bidirectional
# input-image span, time token + output latents see everything, smaller output image padded at the end; (1 - mask) * finfo.min bias.
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, NH, vocab, hidden_size = 32, 4, 50, 32


class OmniGenCollator:
    def __init__(self, pad_token_id=2, hidden_size=hidden_size):
        self.pad_token_id, self.hidden_size = pad_token_id, hidden_size

    def create_position(self, attention_mask, num_tokens_for_output_images):
        position_ids = []
        text_length = attention_mask.size(-1)
        img_length = max(num_tokens_for_output_images)
        for mask in attention_mask:
            temp_l = int(torch.sum(mask))
            position_ids.append([0] * (text_length - temp_l) + list(range(temp_l + img_length + 1)))
        return torch.LongTensor(position_ids)

    def create_mask(self, attention_mask, num_tokens_for_output_images):
        extended_mask, padding_images = [], []
        text_length = attention_mask.size(-1)
        img_length = max(num_tokens_for_output_images)
        seq_len = text_length + img_length + 1
        for inx, mask in enumerate(attention_mask):
            temp_l = int(torch.sum(mask))
            pad_l = text_length - temp_l
            temp_mask = torch.tril(torch.ones(size=(temp_l + 1, temp_l + 1)))
            temp_mask = torch.cat([temp_mask, torch.zeros(size=(temp_l + 1, img_length))], dim=-1)
            temp_mask = torch.cat([temp_mask, torch.ones(size=(img_length, temp_l + img_length + 1))], dim=0)
            if pad_l > 0:
                temp_mask = torch.cat([torch.zeros(size=(temp_l + 1 + img_length, pad_l)), temp_mask], dim=-1)
                temp_mask = torch.cat([torch.ones(size=(pad_l, seq_len)), temp_mask], dim=0)
            pad_img_length = img_length - num_tokens_for_output_images[inx]
            if pad_img_length > 0:
                temp_mask[:, -pad_img_length:] = 0
                padding_images.append(torch.zeros(size=(1, pad_img_length, self.hidden_size)))
            else:
                padding_images.append(None)
            extended_mask.append(temp_mask.unsqueeze(0))
        return torch.cat(extended_mask, dim=0), padding_images

    def adjust_attention_for_input_images(self, attention_mask, image_sizes):
        for b_inx in image_sizes.keys():
            for start_inx, end_inx in image_sizes[b_inx]:
                attention_mask[b_inx][start_inx:end_inx, start_inx:end_inx] = 1
        return attention_mask

    def pad_input_ids(self, input_ids, image_sizes):
        max_l = max(len(x) for x in input_ids)
        padded_ids, attention_mask = [], []
        for i, temp_ids in enumerate(input_ids):
            pad_l = max_l - len(temp_ids)
            attention_mask.append([0] * pad_l + [1] * len(temp_ids))
            padded_ids.append([self.pad_token_id] * pad_l + temp_ids)
            if i in image_sizes:
                image_sizes[i] = [[x + pad_l for x in old] for old in image_sizes[i]]
        return torch.LongTensor(padded_ids), torch.LongTensor(attention_mask), image_sizes


def rope(x, pos):  # x [B, H, L, hd], pos [B, L]
    hd = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2) / hd))
    ang = pos[:, None, :, None].double() * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(D), torch.nn.RMSNorm(D)
        self.qkv, self.o = torch.nn.Linear(D, 3 * D, bias=False), torch.nn.Linear(D, D, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 2 * D, bias=False), torch.nn.SiLU(), torch.nn.Linear(2 * D, D, bias=False))

    def forward(self, x, mask, pos):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, L, 3, NH, D // NH).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rope(q, pos), rope(k, pos), v, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(B, L, D))
        return x + self.mlp(self.n2(x))


embed = torch.nn.Embedding(vocab, D)
time_token = torch.nn.Linear(1, D)
layers = torch.nn.ModuleList([Layer() for _ in range(2)])


def transformer(input_ids, img_embeds, image_sizes, latents, timestep, attention_mask, position_ids):
    h = embed(input_ids).clone()
    for b, spans in image_sizes.items():
        for (s, e), emb in zip(spans, img_embeds[b]):
            h[b, s:e] = emb  # input image patch embeddings replace their placeholder tokens
    h = torch.cat([h, time_token(timestep[:, None, None]), latents], dim=1)
    if attention_mask is not None and attention_mask.ndim == 3:
        min_dtype = torch.finfo(h.dtype).min
        attention_mask = ((1 - attention_mask) * min_dtype).unsqueeze(1).to(h)
    for lyr in layers:
        h = lyr(h, attention_mask, position_ids)
    return h[:, -latents.shape[1] :]


prompts = [[5, 9, 0, 0, 0, 11, 7], [8, 3, 4]]  # sample 0 holds an input image at token span [2, 5)
image_spans = {0: [[2, 5]]}
img_embeds = {0: [torch.randn(3, D)]}
num_tokens_for_output_images = [6, 4]
latents_true = [torch.randn(n, D) for n in num_tokens_for_output_images]
timestep = torch.tensor([0.3, 0.8])

coll = OmniGenCollator()
ids, attn2d, spans = coll.pad_input_ids(prompts, {k: [list(s) for s in v] for k, v in image_spans.items()})
position_ids = coll.create_position(attn2d, num_tokens_for_output_images)
mask, padding_images = coll.create_mask(attn2d, num_tokens_for_output_images)
mask = coll.adjust_attention_for_input_images(mask, spans)
latents = torch.stack([torch.cat([l, p[0]]) if p is not None else l for l, p in zip(latents_true, padding_images)])
shifted = {b: img_embeds[b] for b in spans}

with torch.no_grad():
    got = transformer(ids, shifted, spans, latents, timestep, mask, position_ids)
    worst = 0.0
    for b, p in enumerate(prompts):
        # reference: one sample, no padding; mask written from the rule (causal text, image span both ways, tail sees all)
        n_txt, n_img = len(p), num_tokens_for_output_images[b]
        L = n_txt + 1 + n_img
        allow = torch.tril(torch.ones(L, L, dtype=torch.bool))
        allow[n_txt + 1 :, :] = True
        for s, e in image_spans.get(b, []):
            allow[s:e, s:e] = True
        h = embed(torch.tensor([p])).clone()
        for (s, e), emb in zip(image_spans.get(b, []), img_embeds.get(b, [])):
            h[0, s:e] = emb
        h = torch.cat([h, time_token(timestep[b : b + 1, None, None]), latents_true[b][None]], 1)
        for lyr in layers:
            h = lyr(h, allow, torch.arange(L)[None])
        ref = h[0, -n_img:]
        worst = max(worst, (got[b, : n_img] - ref).abs().max().item())
print(f"left-padded OmniGen batch (padded output latents) vs each sample alone: max diff = {worst:.3e}")
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
