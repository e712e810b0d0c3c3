"""performer-pytorch: the autoregressive wrapper's generate() dropped the encoder's context_mask.

Citation: lucidrains/performer-pytorch commit 53d4b8f ("fix context mask in autoregressive wrapper
again", v0.12.5), following e10ec18 (v0.12.4). Files: performer_pytorch/autoregressive_wrapper.py
(AutoregressiveWrapper.generate), performer_pytorch/performer_enc_dec.py (PerformerEncDec.generate),
performer_pytorch/performer_pytorch.py (SelfAttention, FastAttention, Performer, PerformerLM).

The bug: PerformerEncDec.generate turns `enc_mask` into the decoder's `context_mask` and calls
`self.dec.generate(seq_out_start, seq_len, context=encodings, context_mask=enc_mask)`. generate()
pops `context_mask` from kwargs and only puts a mask back when none was given, so a mask the caller
did pass never reaches the decoder. The cross-attention SelfAttention then falls back to
`context_mask = default(context_mask, mask)`, the decoder's own (all True) input mask, and the
padded source positions are attended through the linear (FAVOR+) cross-attention.

The fix: `kwargs.update(context_mask = context_mask)` after the `if`, for both cases.

Trimmed to CPU: no local-attention heads, SequentialSequence only (no reversible), the non-CUDA
causal linear attention (what the project falls back to without fast_transformers), einops
rearrange / repeat written as reshape / permute / expand, torch.linalg.qr for torch.qr. Source and
target share max_seq_len (as in the README's enc-dec example); the target is primed with a prefix
that fills the decoder's window, so every step feeds max_seq_len decoder tokens.
"""

import math
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

# helpers


def exists(val):
    return val is not None


def empty(tensor):
    return tensor.numel() == 0


def default(val, d):
    return val if exists(val) else d


def cast_tuple(val):
    return (val,) if not isinstance(val, tuple) else val


def split_heads(t, h):
    # rearrange(t, 'b n (h d) -> b h n d', h = h)
    b, n, hd = t.shape
    return t.reshape(b, n, h, hd // h).permute(0, 2, 1, 3)


def merge_heads(t):
    # rearrange(t, 'b h n d -> b n (h d)')
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)


# kernel functions


def softmax_kernel(data, *, projection_matrix, is_query, normalize_data=True, eps=1e-4, device=None):
    b, h, *_ = data.shape

    data_normalizer = (data.shape[-1] ** -0.25) if normalize_data else 1.

    ratio = (projection_matrix.shape[0] ** -0.5)

    projection = projection_matrix[None, None].expand(b, h, *projection_matrix.shape)

    data_dash = torch.einsum('...id,...jd->...ij', (data_normalizer * data), projection)

    diag_data = data ** 2
    diag_data = torch.sum(diag_data, dim=-1)
    diag_data = (diag_data / 2.0) * (data_normalizer ** 2)
    diag_data = diag_data.unsqueeze(dim=-1)

    if is_query:
        data_dash = ratio * (
            torch.exp(data_dash - diag_data -
                      torch.max(data_dash, dim=-1, keepdim=True).values) + eps)
    else:
        data_dash = ratio * (
            torch.exp(data_dash - diag_data - torch.max(data_dash)) + eps)

    return data_dash


def orthogonal_matrix_chunk(cols, qr_uniform_q=False, device=None):
    unstructured_block = torch.randn((cols, cols), device=device)
    q, r = torch.linalg.qr(unstructured_block.cpu(), mode='reduced')
    q, r = map(lambda t: t.to(device), (q, r))

    if qr_uniform_q:
        d = torch.diag(r, 0)
        q *= d.sign()
    return q.t()


def gaussian_orthogonal_random_matrix(nb_rows, nb_columns, scaling=0, qr_uniform_q=False, device=None):
    nb_full_blocks = int(nb_rows / nb_columns)

    block_list = []

    for _ in range(nb_full_blocks):
        q = orthogonal_matrix_chunk(nb_columns, qr_uniform_q=qr_uniform_q, device=device)
        block_list.append(q)

    remaining_rows = nb_rows - nb_full_blocks * nb_columns
    if remaining_rows > 0:
        q = orthogonal_matrix_chunk(nb_columns, qr_uniform_q=qr_uniform_q, device=device)
        block_list.append(q[:remaining_rows])

    final_matrix = torch.cat(block_list)

    if scaling == 0:
        multiplier = torch.randn((nb_rows, nb_columns), device=device).norm(dim=1)
    elif scaling == 1:
        multiplier = math.sqrt((float(nb_columns))) * torch.ones((nb_rows,), device=device)
    else:
        raise ValueError(f'Invalid scaling {scaling}')

    return torch.diag(multiplier) @ final_matrix


# non-causal linear attention
def linear_attention(q, k, v):
    D_inv = 1. / torch.einsum('...nd,...d->...n', q, k.sum(dim=-2))
    context = torch.einsum('...nd,...ne->...de', k, v)
    out = torch.einsum('...de,...nd,...n->...ne', context, q, D_inv)
    return out


# inefficient causal linear attention, without cuda code
def causal_linear_attention_noncuda(q, k, v):
    D_inv = 1. / torch.einsum('...nd,...nd->...n', q, k.cumsum(dim=-2))
    context = torch.einsum('...nd,...ne->...nde', k, v)
    context = context.cumsum(dim=-3)
    out = torch.einsum('...nde,...nd,...n->...ne', context, q, D_inv)
    return out


class FastAttention(nn.Module):
    def __init__(self, dim_heads, nb_features=None, feature_redraw_interval=0, ortho_scaling=0, causal=False, qr_uniform_q=False):
        super().__init__()
        nb_features = default(nb_features, int(dim_heads * math.log(dim_heads)))

        self.dim_heads = dim_heads
        self.nb_features = nb_features
        self.ortho_scaling = ortho_scaling

        self.feature_redraw_interval = feature_redraw_interval
        self.register_buffer('calls_since_last_redraw', torch.tensor(0))

        self.create_projection = partial(gaussian_orthogonal_random_matrix, nb_rows=self.nb_features, nb_columns=dim_heads, scaling=ortho_scaling, qr_uniform_q=qr_uniform_q)
        projection_matrix = self.create_projection()
        self.register_buffer('projection_matrix', projection_matrix)

        self.causal = causal
        if causal:
            # fast_transformers' CUDA kernel is not importable on CPU: the project falls back to this
            self.causal_linear_fn = causal_linear_attention_noncuda

    def forward(self, q, k, v):
        device = q.device

        if exists(self.feature_redraw_interval) and self.calls_since_last_redraw >= self.feature_redraw_interval:
            self.projection_matrix = self.create_projection(device=device).type_as(q)
            self.calls_since_last_redraw = torch.tensor(0)
        else:
            self.calls_since_last_redraw += 1

        create_kernel = partial(softmax_kernel, projection_matrix=self.projection_matrix, device=device)
        q = create_kernel(q, is_query=True)
        k = create_kernel(k, is_query=False)

        attn_fn = linear_attention if not self.causal else self.causal_linear_fn
        out = attn_fn(q, k, v)
        return out


class PreLayerNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class Chunk(nn.Module):
    def __init__(self, chunks, fn, along_dim=-1):
        super().__init__()
        self.dim = along_dim
        self.chunks = chunks
        self.fn = fn

    def forward(self, x, **kwargs):
        if self.chunks == 1:
            return self.fn(x, **kwargs)
        chunks = x.chunk(self.chunks, dim=self.dim)
        return torch.cat([self.fn(c, **kwargs) for c in chunks], dim=self.dim)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0., activation=None, glu=False):
        super().__init__()
        activation = default(activation, nn.GELU)

        self.glu = glu
        self.w1 = nn.Linear(dim, dim * mult * (2 if glu else 1))
        self.act = activation()
        self.dropout = nn.Dropout(dropout)
        self.w2 = nn.Linear(dim * mult, dim)

    def forward(self, x, **kwargs):
        if not self.glu:
            x = self.w1(x)
            x = self.act(x)
        else:
            x, v = self.w1(x).chunk(2, dim=-1)
            x = self.act(x) * v

        x = self.dropout(x)
        x = self.w2(x)
        return x


class SelfAttention(nn.Module):
    def __init__(self, dim, causal=False, heads=8, local_heads=0, local_window_size=256, nb_features=None, feature_redraw_interval=1000, qr_uniform_q=False, dropout=0.):
        super().__init__()
        assert dim % heads == 0, 'dimension must be divisible by number of heads'
        assert local_heads == 0, 'local attention heads are not ported'
        dim_head = dim // heads
        self.fast_attention = FastAttention(dim_head, nb_features, feature_redraw_interval, causal=causal, qr_uniform_q=qr_uniform_q)

        self.heads = heads
        self.global_heads = heads - local_heads

        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, context=None, mask=None, context_mask=None):
        b, n, _, h, gh = *x.shape, self.heads, self.global_heads

        cross_attend = exists(context)
        context = default(context, x)
        context_mask = default(context_mask, mask)

        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)

        q, k, v = map(lambda t: split_heads(t, h), (q, k, v))
        (q, lq), (k, lk), (v, lv) = map(lambda t: (t[:, :gh], t[:, gh:]), (q, k, v))

        attn_outs = []

        if not empty(q):
            if exists(context_mask):
                global_mask = context_mask[:, None, :, None]
                k.masked_fill_(~global_mask, 0)

            out = self.fast_attention(q, k, v)
            attn_outs.append(out)

        out = torch.cat(attn_outs, dim=1)
        out = merge_heads(out)
        out = self.to_out(out)
        return self.dropout(out)


# reversible.py: argument routing and the sequential executor


def route_args(router, args, depth):
    routed_args = [(dict(), dict()) for _ in range(depth)]
    matched_keys = [key for key in args.keys() if key in router]

    for key in matched_keys:
        val = args[key]
        for depth, ((f_args, g_args), routes) in enumerate(zip(routed_args, router[key])):
            new_f_args, new_g_args = map(lambda route: ({key: val} if route else {}), routes)
            routed_args[depth] = ({**f_args, **new_f_args}, {**g_args, **new_g_args})
    return routed_args


class SequentialSequence(nn.Module):
    def __init__(self, layers, args_route={}):
        super().__init__()
        assert all(len(route) == len(layers) for route in args_route.values()), 'each argument route map must have the same depth as the number of sequential layers'
        self.layers = layers
        self.args_route = args_route

    def forward(self, x, **kwargs):
        args = route_args(self.args_route, kwargs, len(self.layers))
        layers_and_args = list(zip(self.layers, args))

        for (f, g), (f_args, g_args) in layers_and_args:
            x = x + f(x, **f_args)
            x = x + g(x, **g_args)
        return x


class Performer(nn.Module):
    def __init__(self, dim, depth, heads, local_attn_heads=0, local_window_size=256, causal=False, ff_mult=4, nb_features=None, reversible=False, ff_chunks=1, qr_uniform_q=False, ff_glu=False, ff_dropout=0., attn_dropout=0., cross_attend=False):
        super().__init__()
        layers = nn.ModuleList([])
        local_attn_heads = cast_tuple(local_attn_heads)
        local_attn_heads = local_attn_heads * depth if len(local_attn_heads) == 1 else local_attn_heads
        assert len(local_attn_heads) == depth

        wrapper_fn = partial(PreLayerNorm, dim)

        for _, local_heads in zip(range(depth), local_attn_heads):
            layers.append(nn.ModuleList([
                wrapper_fn(SelfAttention(dim, causal=causal, heads=heads, local_heads=local_heads, local_window_size=local_window_size, nb_features=nb_features, qr_uniform_q=qr_uniform_q, dropout=attn_dropout)),
                wrapper_fn(Chunk(ff_chunks, FeedForward(dim, mult=ff_mult, dropout=ff_dropout, glu=ff_glu), along_dim=1))
            ]))

            if not cross_attend:
                continue

            layers.append(nn.ModuleList([
                wrapper_fn(SelfAttention(dim, heads=heads, nb_features=nb_features, qr_uniform_q=qr_uniform_q, dropout=attn_dropout)),
                wrapper_fn(Chunk(ff_chunks, FeedForward(dim, mult=ff_mult, dropout=ff_dropout, glu=ff_glu), along_dim=1))
            ]))

        execute_type = SequentialSequence

        route_attn = ((True, False),) * depth * (2 if cross_attend else 1)
        route_context = ((False, False), (True, False)) * depth
        attn_route_map = {'mask': route_attn}
        context_route_map = {'context': route_context, 'context_mask': route_context} if cross_attend else {}
        self.net = execute_type(layers, args_route={**attn_route_map, **context_route_map})

    def forward(self, x, **kwargs):
        return self.net(x, **kwargs)


class PerformerLM(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, dim, depth, heads, local_attn_heads=0, local_window_size=256, causal=False, ff_mult=4, nb_features=None, reversible=False, ff_chunks=1, ff_glu=False, emb_dropout=0., ff_dropout=0., attn_dropout=0., qr_uniform_q=False, cross_attend=False):
        super().__init__()
        local_attn_heads = cast_tuple(local_attn_heads)

        self.max_seq_len = max_seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.dropout = nn.Dropout(emb_dropout)

        nn.init.normal_(self.token_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

        self.performer = Performer(dim, depth, heads, local_attn_heads, local_window_size, causal, ff_mult, nb_features, reversible, ff_chunks, qr_uniform_q, ff_glu, ff_dropout, attn_dropout, cross_attend)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, return_encodings=False, **kwargs):
        b, n, device = *x.shape, x.device
        x = self.token_emb(x)
        x += self.pos_emb(torch.arange(n, device=device))
        x = self.dropout(x)

        x = self.performer(x, **kwargs)

        x = self.norm(x)

        if return_encodings:
            return x

        return x @ self.token_emb.weight.t()


# autoregressive_wrapper.py


def top_k(logits, thres=0.9):
    k = int((1 - thres) * logits.shape[-1])
    val, ind = torch.topk(logits, k)
    probs = torch.full_like(logits, float('-inf'))
    probs.scatter_(1, ind, val)
    return probs


class AutoregressiveWrapper(nn.Module):
    def __init__(self, net, ignore_index=0, pad_value=0):
        super().__init__()
        self.pad_value = pad_value
        self.ignore_index = ignore_index

        self.net = net
        self.max_seq_len = net.max_seq_len

    @torch.no_grad()
    def generate(self, start_tokens, seq_len, eos_token=None, temperature=1., filter_logits_fn=top_k, filter_thres=0.9, **kwargs):
        was_training = self.net.training
        num_dims = len(start_tokens.shape)

        if num_dims == 1:
            start_tokens = start_tokens[None, :]

        b, t = start_tokens.shape

        self.net.eval()
        out = start_tokens
        input_mask = kwargs.pop('mask', None)

        if input_mask is None:
            input_mask = torch.full_like(out, True, dtype=torch.bool, device=out.device)

        # in case of conditional generation, if enc_mask is not provided use the correct context_mask
        context_mask = kwargs.pop('context_mask', None)

        if 'context' in kwargs and not exists(context_mask):
            context = kwargs['context']
            context_mask = torch.full(context.shape[:2], True, dtype=torch.bool, device=out.device)
            if not FIXED:
                kwargs.update(context_mask=context_mask)

        if FIXED:
            kwargs.update(context_mask=context_mask)

        for _ in range(seq_len):
            x = out[:, -self.max_seq_len:]
            input_mask = input_mask[:, -self.max_seq_len:]
            logits = self.net(x, mask=input_mask, **kwargs)[:, -1, :]
            filtered_logits = filter_logits_fn(logits, thres=filter_thres)
            probs = F.softmax(filtered_logits / temperature, dim=-1)
            sample = torch.multinomial(probs, 1)

            out = torch.cat((out, sample), dim=-1)
            input_mask = F.pad(input_mask, (0, 1), value=True)

            if eos_token is not None and (sample == eos_token).all():
                break

        out = out[:, t:]

        if num_dims == 1:
            out = out.squeeze(0)

        self.net.train(was_training)
        return out


# performer_enc_dec.py

ENC_PREFIX = 'enc_'
DEC_PREFIX = 'dec_'


def group_dict_by_key(cond, d):
    return_val = [dict(), dict()]
    for key in d.keys():
        match = bool(cond(key))
        ind = int(not match)
        return_val[ind][key] = d[key]
    return (*return_val,)


def string_begins_with(prefix, str):
    return str.startswith(prefix)


def group_by_key_prefix_and_remove_prefix(prefix, d):
    kwargs_with_prefix, kwargs = group_dict_by_key(lambda x: string_begins_with(prefix, x), d)
    kwargs_without_prefix = dict(map(lambda x: (x[0][len(prefix):], x[1]), tuple(kwargs_with_prefix.items())))
    return kwargs_without_prefix, kwargs


def extract_enc_dec_kwargs(kwargs):
    enc_kwargs, kwargs = group_by_key_prefix_and_remove_prefix(ENC_PREFIX, kwargs)
    dec_kwargs, kwargs = group_by_key_prefix_and_remove_prefix(DEC_PREFIX, kwargs)
    return enc_kwargs, dec_kwargs, kwargs


def extract_and_set_enc_dec_kwargs(kwargs):
    enc_kwargs, dec_kwargs, kwargs = extract_enc_dec_kwargs(kwargs)
    if 'mask' in enc_kwargs:
        dec_kwargs.setdefault('context_mask', enc_kwargs['mask'])
    return enc_kwargs, dec_kwargs, kwargs


class PerformerEncDec(nn.Module):
    def __init__(self, dim, ignore_index=0, pad_value=0, tie_token_embeds=False, **kwargs):
        super().__init__()
        enc_kwargs, dec_kwargs, _ = extract_enc_dec_kwargs(kwargs)

        assert 'dim' not in dec_kwargs and 'dim' not in enc_kwargs, 'you must set the dim for both encoder and decoder'

        enc_kwargs['dim'] = dec_kwargs['dim'] = dim
        dec_kwargs['causal'] = True
        dec_kwargs['cross_attend'] = True

        enc = PerformerLM(**enc_kwargs)
        dec = PerformerLM(**dec_kwargs)

        if tie_token_embeds:
            enc.token_embed = dec.token_embed

        self.enc = enc
        self.dec = AutoregressiveWrapper(dec, ignore_index=ignore_index, pad_value=pad_value)

    def generate(self, seq_in, seq_out_start, seq_len, **kwargs):
        enc_kwargs, dec_kwargs, kwargs = extract_and_set_enc_dec_kwargs(kwargs)
        encodings = self.enc(seq_in, return_encodings=True, **enc_kwargs)
        return self.dec.generate(seq_out_start, seq_len, context=encodings, **{**dec_kwargs, **kwargs})

    def forward(self, seq_in, seq_out, return_loss=False, **kwargs):
        enc_kwargs, dec_kwargs, kwargs = extract_and_set_enc_dec_kwargs(kwargs)
        encodings = self.enc(seq_in, return_encodings=True, **enc_kwargs)
        return self.dec(seq_out, context=encodings, return_loss=return_loss, **dec_kwargs)


def main():
    torch.manual_seed(0)

    SRC_SEQ_LEN = 12
    TGT_SEQ_LEN = 12
    GENERATE_LEN = 16
    NUM_TOKENS = 64
    PAD = 0

    enc_dec = PerformerEncDec(
        dim=32,
        enc_num_tokens=NUM_TOKENS,
        enc_depth=2,
        enc_heads=4,
        enc_max_seq_len=SRC_SEQ_LEN,
        dec_num_tokens=NUM_TOKENS,
        dec_depth=2,
        dec_heads=4,
        dec_max_seq_len=TGT_SEQ_LEN,
    )
    enc_dec.eval()

    # two source sentences, right-padded to SRC_SEQ_LEN: lengths 12 and 5
    src_lens = torch.tensor([12, 5])
    src = torch.randint(1, NUM_TOKENS, (2, SRC_SEQ_LEN))
    src_mask = torch.arange(SRC_SEQ_LEN)[None, :] < src_lens[:, None]
    src = src.masked_fill(~src_mask, PAD)

    # target prefix that fills the decoder window; generation continues it
    prime = torch.randint(1, NUM_TOKENS, (2, TGT_SEQ_LEN))

    # keep the decoder's logits of each generation step
    step_logits = []
    enc_dec.dec.net.register_forward_hook(lambda mod, inp, out: step_logits.append(out[:, -1, :]))

    torch.manual_seed(1)
    samples = enc_dec.generate(src, prime, seq_len=GENERATE_LEN, enc_mask=src_mask)
    print("generated:", samples.tolist())
    last = torch.stack(step_logits, dim=1)  # (b, steps, vocab)
    print("first-step log-probs, row 1 (source of 5 tokens), top 5:",
          [round(v, 4) for v in last[1, 0].log_softmax(-1).topk(5).values.tolist()])
    print("sum of |logits| over steps per row:", [round(v, 4) for v in last.abs().sum(dim=(1, 2)).tolist()])


if __name__ == "__main__":
    main()
