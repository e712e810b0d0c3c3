# Transfusion (lucidrains/transfusion-pytorch): one transformer that predicts text autoregressively
# and denoises image latents by flow matching. Each image sits in the token stream as
#     [meta] [shape chars, e.g. "2,3"] [som] [latent tokens ...] [eom]
# and its (type, offset, length) entry in `modality_positions` is where the joint attention mask
# (causal for text, bidirectional inside an image: naive_attn_mask on CPU, the flex block mask on
# CUDA), the is-modality mask, the rotary positions and the placement of the latent tokens are all
# read from.
#
# Citation: lucidrains/transfusion-pytorch commit 9feb1b7 ("resolve offending bug for issue
# https://github.com/lucidrains/transfusion-pytorch/issues/22"), transfusion_pytorch/transfusion.py
# Transfusion.forward; buggy parent 997531a.
#
# Before: after the meta tag and the shape string were put in front of [som], the recorded offset
# stayed `offset + 1` ("due to extra [som] token"), so each image's span starts on the first shape
# character, len(shape chars) + 1 tokens before its latents.
# After: `offset + prec_meta_tag_length` (len(modality_meta_info) + 2), the first latent token.
#
# Ported to plain torch (einx / einops / rotary_embedding_torch written out by hand), the CPU path
# (no flex attention), no KV cache, no velocity consistency, one modality type.
import math
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn, tensor, is_tensor
from torch.nn import Module, ModuleList, Linear
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

pad_sequence = partial(pad_sequence, batch_first=True)


# helper functions

def exists(v):
    return v is not None


def default(v, d):
    return v if exists(v) else d


def prepend(arr, el):
    arr.insert(0, el)


def join(arr, delimiter=''):
    return delimiter.join(arr)


def cast_tuple(t, length=1):
    return t if isinstance(t, tuple) else ((t,) * length)


def default_modality_length_to_time_fn(modality_length):
    total_modalities, device = modality_length.shape[-1], modality_length.device

    num_modalities = (modality_length > 0).sum(dim=-1).float()
    rand_num_modalities = torch.floor(torch.rand_like(num_modalities) * num_modalities)
    seq = torch.arange(total_modalities, device=device)

    prev_decoded_modality = seq[None, :] <= rand_num_modalities[:, None]
    curr_modality_rand_time = torch.rand_like(num_modalities)

    return torch.where(prev_decoded_modality, 0.5, curr_modality_rand_time[:, None])


def char_tokenize(text, device=None, offset=0):
    return tensor([*map(ord, text)], device=device) + offset


# tensor helpers

def l2norm(t):
    return F.normalize(t, dim=-1)


def softclamp(t, value=50.):
    return (t / value).tanh() * value


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


def calc_direction_loss(pred, target):
    return 0.5 * (1. - (l2norm(pred) * l2norm(target)).sum(dim=-1))


# converting a raw list of modality offsets and lengths to tensor

def modality_positions_to_tensor(modalities, pad_value=0, device=None):
    modalities = [tensor(modality, device=device) for modality in modalities]
    modalities = pad_sequence(modalities, padding_value=pad_value)

    if modalities.ndim == 2:
        modalities = modalities.reshape(*modalities.shape, 3)

    return modalities.long()


def order_modality_positions_by_seq_offset(modalities):
    type, offsets, lengths = modalities.unbind(dim=-1)

    no_modality_mask = lengths <= 0
    offsets_to_sort = offsets.masked_fill(no_modality_mask, 10 ** 10)
    _, sorted_indices = offsets_to_sort.sort(dim=-1)

    modalities = modalities.gather(1, sorted_indices[..., None].expand_as(modalities))
    return modalities, sorted_indices


def modality_positions_to_is_modality_mask(seq_len, modalities, offset=None, device=None, num_modalities=1):
    device = modalities.device

    if exists(offset):
        offset = F.pad(offset, (1, 0))
        modalities = modalities + offset.to(modalities)

    seq = torch.arange(seq_len, device=device)
    type_seq = torch.arange(num_modalities, device=device)

    modality_types = modalities[..., 0]

    left, right = modalities[..., 1:].cumsum(dim=-1).unbind(dim=-1)

    is_instance_for_type = modality_types[:, None, :] == type_seq[None, :, None]    # b t m

    is_modality_along_seq = (
        (seq[None, None, :] >= left[..., None]) &
        (seq[None, None, :] < right[..., None])
    )                                                                               # b m n

    return is_instance_for_type[..., None] & is_modality_along_seq[:, None]        # b t m n


def naive_attn_mask(seq_len, modalities, device=None):
    _, offsets, length = modalities.unbind(dim=-1)

    seq = torch.arange(seq_len, device=device)

    is_causal = seq[:, None] >= seq[None, :]

    is_modality = (
        (seq[None, None, :, None] >= offsets[..., None, None]) &
        (seq[None, None, None, :] < (offsets + length)[..., None, None])
    )                                                                               # b m i j

    return is_causal | is_modality.any(dim=1)


def derive_rotary_positions_from_modality_positions(seq_len, modalities):
    device = modalities.device

    modality_mask = modality_positions_to_is_modality_mask(seq_len, modalities, offset=torch.tensor([1, -1]))
    is_any_modality = modality_mask.any(dim=2).any(dim=1)

    return torch.arange(seq_len, device=device) - is_any_modality.cumsum(dim=-1)


def embed_modality_tokens(seq_len, dim, modality_tokens, modalities, modality_id):
    batch, device = modalities.shape[0], modalities.device

    output = torch.zeros((batch, seq_len, dim), device=device)

    for batch_ind, (one_modality, one_modality_token) in enumerate(zip(modalities, modality_tokens)):
        for (type, offset, length), batch_modality_token in zip(one_modality, one_modality_token):

            if modality_id != type or length <= 0:
                continue

            output[batch_ind, offset:(offset + length)] = batch_modality_token

    return output


# rotary (rotary_embedding_torch, interleaved pairs)

class RotaryEmbedding(Module):
    def __init__(self, dim, theta=10000):
        super().__init__()
        freqs = 1. / (theta ** (torch.arange(0, dim, 2)[:(dim // 2)].float() / dim))
        self.register_buffer('freqs', freqs, persistent=False)

    def forward(self, t):
        freqs = t.float()[..., None] * self.freqs
        return freqs.repeat_interleave(2, dim=-1)


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.reshape(*x.shape[:-2], -1)


def apply_rotary_emb(freqs, t, freqs_seq_dim=-2):
    seq_len = t.shape[freqs_seq_dim]
    freqs = freqs[..., -seq_len:, :]
    return t * freqs.cos() + rotate_half(t) * freqs.sin()


# random fourier embedding

class RandomFourierEmbed(Module):
    def __init__(self, dim):
        super().__init__()
        assert dim % 2 == 0
        self.dim = dim
        self.register_buffer('weights', torch.randn(dim // 2))

    def forward(self, times):
        if times.ndim == 1:
            times = times[:, None]

        freqs = times[..., None] * self.weights * 2 * torch.pi
        return torch.cat((times[..., None], freqs.sin(), freqs.cos()), dim=-1)


# adaptive layernorm and ada-ln zero rolled into one wrapper

class AdaptiveWrapper(Module):
    def __init__(self, fn, dim, dim_cond, ada_ln_zero_init_bias=-2):
        super().__init__()
        self.fn = fn
        self.dim = dim
        self.dim_cond = dim_cond

        self.layernorm = nn.LayerNorm(dim, elementwise_affine=False)

        self.layernorm_gamma = nn.Parameter(torch.zeros(dim))
        self.layerscale = nn.Parameter(torch.zeros(dim))

        self.to_film = Linear(dim_cond, dim * 2)
        self.to_ada_ln_zero = Linear(dim_cond, dim)

        nn.init.zeros_(self.to_film.weight)
        nn.init.zeros_(self.to_ada_ln_zero.weight)
        nn.init.constant_(self.to_ada_ln_zero.bias, ada_ln_zero_init_bias)

    def forward(self, x, cond=None, is_any_modality=None, **kwargs):
        if exists(cond) and cond.ndim == 2:
            cond = cond[:, None, :]

        is_any_modality = is_any_modality[..., None]

        x = self.layernorm(x)

        gamma, beta = self.to_film(cond).chunk(2, dim=-1)

        text_tokens = x * (self.layernorm_gamma + 1.)

        modality_tokens = x * (gamma + 1.) + beta

        x = torch.where(is_any_modality, modality_tokens, text_tokens)

        out = self.fn(x, **kwargs)

        text_out = out * (self.layerscale + 1.)

        modalities_out = out * self.to_ada_ln_zero(cond).sigmoid()

        return torch.where(is_any_modality, modalities_out, text_out)


class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return l2norm(x) * self.scale * (self.gamma + 1.)


class GEGLU(Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return F.gelu(gates) * x


def FeedForward(dim, expansion_factor=4., dropout=0.):
    dim_inner = int(dim * expansion_factor * 2 / 3)
    return nn.Sequential(
        Linear(dim, dim_inner * 2),
        GEGLU(),
        nn.Dropout(dropout),
        Linear(dim_inner, dim)
    )


class Attention(Module):
    def __init__(self, dim, dim_head=64, heads=8, dropout=0., softcap_value=50., gate_values=True):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        dim_inner = dim_head * heads

        self.to_qkv = Linear(dim, dim_inner * 3, bias=False)
        self.to_gates = Linear(dim, heads, bias=False) if gate_values else None

        self.softcap_value = softcap_value
        self.dropout = nn.Dropout(dropout)
        self.to_out = Linear(dim_inner, dim, bias=False)

    def forward(self, x, attn_mask=None, rotary_emb=None, causal=False):
        device = x.device
        b, n, _ = x.shape

        # 'b n (qkv h d) -> qkv b h n d'
        q, k, v = self.to_qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)

        if exists(rotary_emb):
            q, k = tuple(apply_rotary_emb(rotary_emb, t, freqs_seq_dim=-2) for t in (q, k))

        q = q * self.scale
        sim = torch.einsum('b h i d, b h j d -> b h i j', q, k)

        sim = softclamp(sim, self.softcap_value)

        mask_value = max_neg_value(sim)

        if causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, mask_value)

        if exists(attn_mask):
            # einx.where('b i j, b h i j, -> b h i j', attn_mask, sim, mask_value)
            sim = torch.where(attn_mask[:, None], sim, mask_value)

        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)

        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)

        if exists(self.to_gates):
            out = out * self.to_gates(x).transpose(1, 2)[..., None].sigmoid()

        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Transformer(Module):
    def __init__(self, dim, *, depth, dim_head=64, heads=8, dropout=0., ff_expansion_factor=4, unet_skips=True):
        super().__init__()
        self.dim = dim
        self.dim_head = dim_head

        self.to_time_cond = nn.Sequential(
            RandomFourierEmbed(dim),
            Linear(dim + 1, dim * 4),
            nn.SiLU()
        )

        layers = ModuleList([])

        for ind in range(depth):
            is_latter_half = ind >= (depth / 2)

            skip_proj = Linear(dim * 2, dim, bias=False) if is_latter_half and unet_skips else None

            attn = Attention(dim=dim, dim_head=dim_head, heads=heads, dropout=dropout)
            ff = FeedForward(dim=dim, expansion_factor=ff_expansion_factor)

            attn = AdaptiveWrapper(attn, dim=dim, dim_cond=dim * 4)
            ff = AdaptiveWrapper(ff, dim=dim, dim_cond=dim * 4)

            layers.append(ModuleList([skip_proj, attn, ff]))

        self.layers = layers
        self.norm = RMSNorm(dim)

    def forward(self, x, times=None, attn_mask=None, modality_positions=None, is_any_modality=None,
                rotary_emb=None, causal_mask=False):
        batch, seq_len, device = x.shape[0], x.shape[-2], x.device

        assert not (exists(attn_mask) and exists(modality_positions))

        cond = None

        if exists(times):
            if times.ndim == 0:
                times = times.expand(batch)

            cond = self.to_time_cond(times)

        # create the specialized mask needed for autoregressive text + bidirectional flow attention

        attn_mask_kwargs = dict()

        if causal_mask:
            attn_mask_kwargs.update(causal=True)

        if exists(modality_positions):
            assert not causal_mask

            attn_mask = naive_attn_mask(seq_len, modality_positions, device=device)
            attn_mask_kwargs.update(attn_mask=attn_mask)

        if not exists(is_any_modality) and exists(modality_positions):
            is_any_modality = modality_positions_to_is_modality_mask(seq_len, modality_positions).any(dim=1)
            is_any_modality = is_any_modality.any(dim=1)

        adaptive_kwargs = dict(cond=cond, is_any_modality=is_any_modality)

        skips = []
        depth = len(self.layers)

        for ind, (skip_proj, attn, ff) in enumerate(self.layers):
            layer = ind + 1

            is_first_half = layer <= (depth // 2)
            is_later_half = not is_first_half

            if is_first_half:
                skips.append(x)

            if is_later_half and exists(skip_proj):
                skip = skips.pop()

                residual = x
                x = torch.cat((x, skip), dim=-1)
                x = skip_proj(x) + residual

            attn_out = attn(x, rotary_emb=rotary_emb, **attn_mask_kwargs, **adaptive_kwargs)

            x = attn_out + x
            x = ff(x, **adaptive_kwargs) + x

        assert len(skips) == 0

        return self.norm(x)


class Transfusion(Module):
    def __init__(self, *, num_text_tokens, transformer, dim_latent=None, ignore_index=-1,
                 flow_loss_weight=1., add_flow_direction_loss=True, direction_loss_weight=1.):
        super().__init__()

        if isinstance(transformer, dict):
            transformer = Transformer(**transformer)

        self.transformer = transformer
        dim = transformer.dim
        self.dim = dim

        dim_latent = default(dim_latent, dim)
        self.dim_latents = cast_tuple(dim_latent)
        self.num_modalities = len(self.dim_latents)

        # entire "sentence" start and end id

        num_text_special_ids = 2
        self.sos_id, self.eos_id = num_text_tokens, (num_text_tokens + 1)

        # modality meta, start and end tokens - termed [mom] [som] [eom] in this repo

        num_modality_special_ids = self.num_modalities * 2
        som_eom_tensor = torch.arange(num_modality_special_ids) + num_text_tokens + num_text_special_ids
        som_eom_tensor = som_eom_tensor.reshape(2, self.num_modalities)

        self.som_ids, self.eom_ids = som_eom_tensor.tolist()

        meta_token_offset = num_text_tokens + num_text_special_ids + num_modality_special_ids
        self.meta_id = meta_token_offset
        self.char_tokenizer = partial(char_tokenize, offset=meta_token_offset + 1)

        num_meta_tokens = 128 + 1

        self.latent_to_model_projs = ModuleList([Linear(dim_latent, dim) if dim_latent != dim else nn.Identity() for dim_latent in self.dim_latents])

        self.rotary_emb = RotaryEmbedding(transformer.dim_head)

        effective_num_text_tokens = num_text_tokens + num_text_special_ids + num_modality_special_ids + num_meta_tokens

        self.text_embed = nn.Embedding(effective_num_text_tokens, dim)
        self.to_text_logits = Linear(dim, effective_num_text_tokens, bias=False)

        self.model_to_latent_preds = ModuleList([Linear(dim, dim_latent, bias=False) for dim_latent in self.dim_latents])

        self.ignore_index = ignore_index
        self.flow_loss_weight = flow_loss_weight
        self.add_flow_direction_loss = add_flow_direction_loss
        self.direction_loss_weight = direction_loss_weight

    @property
    def device(self):
        return next(self.parameters()).device

    def forward(self, modalities, times=None, modality_length_to_times_fn=None, return_loss=True, return_breakdown=False):
        device = self.device
        tensor_ = partial(tensor, device=device)

        # add "sentence" start and end tokens when training

        if return_loss:
            for modality in modalities:
                prepend(modality, tensor_([self.sos_id]))
                modality.append(tensor_([self.eos_id]))

        # process list of text and modalities interspersed with one another

        modality_positions = []
        modality_tokens = []

        text = []

        for batch_modalities in modalities:
            batch_modality_positions = []
            batch_modality_tokens = []
            batch_text = []
            offset = 0

            for modality in batch_modalities:
                if is_tensor(modality) and modality.dtype == torch.float:
                    modality = (0, modality)

                is_text = not isinstance(modality, tuple)

                if is_text:
                    modality_tensor = modality
                else:
                    modality_type, modality_tensor = modality

                    assert 0 <= modality_type < self.num_modalities
                    assert self.dim_latents[modality_type] == modality_tensor.shape[-1]

                modality_tensor = modality_tensor.to(device)

                # handle text

                if is_text:
                    assert modality_tensor.ndim == 1
                    text_length = modality_tensor.shape[0]

                    batch_text.append(modality_tensor)
                    offset += text_length
                    continue

                # otherwise handle a modality

                modality_shape_tuple = tuple(modality_tensor.shape[:-1])
                modality_length = math.prod(modality_shape_tuple)

                text_tensor = torch.full((modality_length,), -1, device=device)  # text is all -1 here, so text labels are not learned on

                som_id, eom_id = self.som_ids[modality_type], self.eom_ids[modality_type]

                modality_shape_str = join([*map(str, modality_shape_tuple)], ',')
                modality_meta_info = self.char_tokenizer(modality_shape_str, device=device)

                prec_meta_tag_length = len(modality_meta_info) + 2

                text_tensor = torch.cat((
                    tensor_([self.meta_id]),
                    modality_meta_info,
                    tensor_([som_id]),
                    text_tensor,
                    tensor_([eom_id])
                ))

                batch_text.append(text_tensor)
                modality_tensor = modality_tensor.reshape(-1, modality_tensor.shape[-1])

                batch_modality_tokens.append(modality_tensor)

                if FIXED:
                    batch_modality_positions.append((modality_type, offset + prec_meta_tag_length, modality_length))
                else:
                    batch_modality_positions.append((modality_type, offset + 1, modality_length))  # offset + 1 due to extra [som] token

                offset += modality_length + 2 + len(modality_meta_info) + 1  # +2 due to [som] and [eom] - then account for meta start id and modality shape information

            text.append(torch.cat(batch_text))

            modality_tokens.append(batch_modality_tokens)
            modality_positions.append(batch_modality_positions)

        text = pad_sequence(text, padding_value=-1)

        # if returning loss, split text for next token prediction

        if return_loss:
            text, text_labels = text[:, :-1], text[:, 1:]

        # derive is_modality mask for flow on the right tokens + flow loss

        batch, seq_len = text.shape

        assert len(modality_positions) == batch

        if isinstance(modality_positions, list):
            modality_positions = modality_positions_to_tensor(modality_positions, device=device)

        # embed the list of modality tokens into one Tensor

        modality_tokens = [embed_modality_tokens(seq_len, dim_latent, modality_tokens, modality_positions, modality_id) for modality_id, dim_latent in enumerate(self.dim_latents)]

        modality_positions, sorted_indices = order_modality_positions_by_seq_offset(modality_positions)

        is_modalities = modality_positions_to_is_modality_mask(seq_len, modality_positions, num_modalities=self.num_modalities, device=device)

        is_any_modality = is_modalities.any(dim=2).any(dim=1)

        # embed text

        text = text.masked_fill(text == -1, 0)

        text_tokens = self.text_embed(text)

        # times

        if not exists(times):
            modality_length_to_times_fn = default(modality_length_to_times_fn, default_modality_length_to_time_fn)
            times = modality_length_to_times_fn(modality_positions[..., -1])

        times_per_token = torch.einsum('b t m n, b m -> b t n', is_modalities.float(), times)

        # noise the modality tokens

        if return_loss:
            noised_modality_tokens = []
            flows = []

            for modality_id, one_modality_tokens in enumerate(modality_tokens):
                noise = torch.randn_like(one_modality_tokens)

                one_times = times_per_token[:, modality_id]
                padded_times = one_times[..., None]

                one_noised_modality_tokens = one_modality_tokens * padded_times + noise * (1. - padded_times)

                one_flow = one_modality_tokens - noise

                flows.append(one_flow)
                noised_modality_tokens.append(one_noised_modality_tokens)

            modality_tokens = noised_modality_tokens

        modality_tokens = [fn(one_modality_tokens) for fn, one_modality_tokens in zip(self.latent_to_model_projs, modality_tokens)]
        modality_tokens = sum(modality_tokens)

        # intersperse the modalities with the text for the joint transformer + flow system

        tokens = torch.where(is_any_modality[..., None], modality_tokens, text_tokens)

        # derive rotary positions

        rotary_positions = derive_rotary_positions_from_modality_positions(seq_len, modality_positions)

        rotary_emb = self.rotary_emb(rotary_positions)
        rotary_emb = rotary_emb[:, None]

        times_cond = times_per_token.sum(dim=1)

        # attention

        embed = self.transformer(
            tokens,
            times=times_cond,
            rotary_emb=rotary_emb,
            modality_positions=modality_positions,
        )

        text_logits = self.to_text_logits(embed)

        if not return_loss:
            return text_logits

        # flow loss

        pred_flows = [fn(embed) for fn in self.model_to_latent_preds]

        total_tokens = (text_labels != self.ignore_index).sum()

        text_labels = text_labels.masked_fill(is_any_modality, self.ignore_index)

        text_loss = F.cross_entropy(
            text_logits.transpose(1, 2),
            text_labels,
            ignore_index=self.ignore_index
        )

        text_loss_weight = (text_labels != self.ignore_index).sum() / total_tokens

        flow_losses = []
        direction_losses = []
        modality_loss_weights = []

        for flow, pred_flow, is_one_modality in zip(flows, pred_flows, is_modalities.unbind(dim=1)):

            flow_loss = F.mse_loss(pred_flow, flow, reduction='none')

            is_one_modality = is_one_modality.any(dim=1)

            flow_loss = flow_loss[is_one_modality].mean()

            if self.add_flow_direction_loss:
                direction_loss = calc_direction_loss(pred_flow, flow)
                direction_loss = direction_loss[is_one_modality].mean()
                direction_losses.append(direction_loss)

            modality_loss_weights.append(is_one_modality.sum() / total_tokens)
            flow_losses.append(flow_loss)

        modality_loss_weights = torch.stack(modality_loss_weights)

        total_loss = (
            text_loss * text_loss_weight +
            (torch.stack(flow_losses) * modality_loss_weights).sum() * self.flow_loss_weight
        )

        if self.add_flow_direction_loss:
            total_loss = total_loss + (torch.stack(direction_losses) * modality_loss_weights).sum() * self.direction_loss_weight

        if not return_breakdown:
            return total_loss

        return total_loss, (text_loss, flow_losses, direction_losses)


def main():
    model = Transfusion(
        num_text_tokens=16,
        dim_latent=6,
        transformer=dict(dim=32, depth=2, dim_head=8, heads=4),
    )
    model.eval()

    # two samples: text, an image of latents, text (train_toy.py's layout, tiny)
    gen = torch.Generator().manual_seed(1)
    text_images_and_more = [
        [torch.randint(0, 16, (3,), generator=gen), (0, torch.randn(2, 3, 6, generator=gen)), torch.randint(0, 16, (2,), generator=gen)],
        [torch.randint(0, 16, (5,), generator=gen), (0, torch.randn(2, 2, 6, generator=gen)), torch.randint(0, 16, (1,), generator=gen)],
    ]

    torch.manual_seed(2)
    with torch.no_grad():
        loss, (text_loss, flow_losses, direction_losses) = model(text_images_and_more, return_breakdown=True)

    print(f"total loss     {loss.item():.6f}")
    print(f"text loss      {text_loss.item():.6f}")
    print(f"flow loss      {flow_losses[0].item():.6f}")
    print(f"direction loss {direction_losses[0].item():.6f}")


if __name__ == "__main__":
    main()
