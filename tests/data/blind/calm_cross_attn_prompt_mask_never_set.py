# lucidrains/CALM-pytorch commit ffed84d ("move the setting and unsetting of the prompt masks (for masking
# during cross attention from anchor) into a contextmanager").
#
# CALM (composition to augment language models): a frozen anchor LLM cross-attends, through forward hooks on
# its blocks, to the hidden states a frozen augment LLM recorded for a (right-padded) prompt. Before the fix,
# forward_augments built the prompt masks from pad_id but kept them to itself; CALM.forward then set every
# cross-attention's context mask from its own `prompt_mask` argument, which is None when the caller leaves the
# masks to be derived. The fix returns the prompt masks from forward_augments and sets, for each augment LLM,
# its own mask on its cross-attention blocks (set_cross_attn_masks).
#
# Ported to plain torch at tiny sizes (x-transformers' TransformerWrapper / Attention trimmed to what is used).
import sys
from contextlib import nullcontext, contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Module, ModuleList

FIXED = "--fixed" in sys.argv


def exists(v):
    return v is not None


def cast_tuple(t, length=1):
    return t if isinstance(t, tuple) else ((t,) * length)


# --- x-transformers pieces, trimmed ---------------------------------------------------------------------

class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.g


class Attention(Module):
    def __init__(self, dim, dim_context=None, heads=2, dim_head=8, causal=False,
                 zero_init_output=False, gate_value_heads=False):
        super().__init__()
        dim_context = dim_context if exists(dim_context) else dim
        self.heads = heads
        self.causal = causal
        self.scale = dim_head ** -0.5
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim_context, inner, bias=False)
        self.to_v = nn.Linear(dim_context, inner, bias=False)
        self.to_v_head_gate = nn.Linear(dim, heads) if gate_value_heads else None
        self.to_out = nn.Linear(inner, dim, bias=False)
        if zero_init_output:
            nn.init.zeros_(self.to_out.weight)

    def forward(self, x, context=None, mask=None, context_mask=None):
        b, n, _ = x.shape
        h = self.heads
        kv_input = context if exists(context) else x
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        q, k, v = (t.reshape(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))

        input_mask = context_mask if exists(context) else mask

        sim = (q @ k.transpose(-1, -2)) * self.scale
        mask_value = -torch.finfo(sim.dtype).max

        if exists(input_mask):
            input_mask = input_mask[:, None, None, :]          # 'b j -> b 1 1 j'
            sim = sim.masked_fill(~input_mask, mask_value)

        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, mask_value)

        attn = sim.softmax(dim=-1)
        out = attn @ v

        if exists(self.to_v_head_gate):
            gates = self.to_v_head_gate(x).transpose(1, 2)[..., None]   # b h n 1
            out = out * gates.sigmoid()

        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class FeedForward(Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class Residual(Module):
    def forward(self, x, residual):
        return x + residual


class AttentionLayers(Module):
    # layers: ModuleList([ModuleList([norm, block, residual]), ...]) as x-transformers lays them
    def __init__(self, dim, depth, heads=2, causal=False):
        super().__init__()
        self.causal = causal
        self.layers = ModuleList([])
        for _ in range(depth):
            for kind in ("a", "f"):
                block = Attention(dim, heads=heads, causal=causal) if kind == "a" else FeedForward(dim)
                self.layers.append(ModuleList([RMSNorm(dim), block, Residual()]))
        self.final_norm = RMSNorm(dim)

    def forward(self, x, mask=None):
        for norm, block, residual_fn in self.layers:
            residual = x
            x = norm(x)
            x = block(x, mask=mask) if isinstance(block, Attention) else block(x)
            x = residual_fn(x, residual)
        return self.final_norm(x)


class TransformerWrapper(Module):
    def __init__(self, num_tokens, max_seq_len, dim, depth, causal):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.attn_layers = AttentionLayers(dim, depth, causal=causal)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, mask=None):
        pos = torch.arange(x.shape[1])
        x = self.token_emb(x) + self.pos_emb(pos)
        x = self.attn_layers(x, mask=mask)
        return self.to_logits(x)


def x_transformer_blocks(transformer: Module):
    blocks = []
    for layer in transformer.attn_layers.layers:
        blocks.append(layer[-1])
    return blocks


# --- CALM -------------------------------------------------------------------------------------------------

class Recorder:
    def __init__(self):
        self.output = None
        self.release = True

    def __call__(self, _, inp, output):
        self.output = output.detach()

    def pop_saved(self):
        output = self.output
        assert exists(output)
        if self.release:
            self.output = None
        return output


class CrossAttentionBlock(Module):
    def __init__(self, dim, dim_context, recorder, linear_project_context=True, pre_rmsnorm=False, **kwargs):
        super().__init__()
        self.pre_rmsnorm = RMSNorm(dim) if pre_rmsnorm else nn.Identity()
        self.recorder = recorder
        self.context_proj = None
        if linear_project_context:
            self.context_proj = nn.Linear(dim_context, dim)
            dim_context = dim
        self.attn = Attention(dim=dim, dim_context=dim_context, zero_init_output=True, gate_value_heads=True, **kwargs)
        self.context_mask = None

    def set_mask(self, mask):
        self.context_mask = mask

    def unset_mask(self):
        self.context_mask = None

    def forward(self, _, inp, out):
        x = out
        context = self.recorder.pop_saved()
        maybe_enable_grad = torch.enable_grad if self.training else nullcontext
        with maybe_enable_grad():
            res = x
            x = self.pre_rmsnorm(x)
            if exists(self.context_proj):
                context = self.context_proj(context)
            out = self.attn(x, context, context_mask=self.context_mask) + res
        return out


class CALM(Module):
    def __init__(self, anchor_llm, augment_llms, pad_id=0, dim=16, dim_augment=12, connect_every=2):
        super().__init__()
        self.anchor_llm = anchor_llm
        self.augment_llms = ModuleList(cast_tuple(augment_llms))
        self.pad_id = pad_id
        self.mask_kwargs = [None] * len(self.augment_llms)   # augment llm not handed the mask (default)

        anchor_blocks = x_transformer_blocks(anchor_llm)
        self.cross_attns = ModuleList([])
        for augment_llm in self.augment_llms:
            augment_blocks = x_transformer_blocks(augment_llm)
            anchor_hook = anchor_blocks[connect_every - 1::connect_every]
            augment_hook = augment_blocks[connect_every - 1::connect_every]
            one_cross_attns = ModuleList([])
            for anchor_block, augment_block in zip(anchor_hook, augment_hook):
                recorder = Recorder()
                cross_attn = CrossAttentionBlock(dim=dim, dim_context=dim_augment, recorder=recorder)
                augment_block.register_forward_hook(recorder)
                anchor_block.register_forward_hook(cross_attn)
                one_cross_attns.append(cross_attn)
            self.cross_attns.append(one_cross_attns)

    def forward_augments(self, prompt, prompt_mask=None):
        num_augment_llms = len(self.augment_llms)
        prompts = cast_tuple(prompt, num_augment_llms)
        assert len(prompts) == num_augment_llms

        if not exists(prompt_mask):
            prompt_mask = tuple((p != self.pad_id if not torch.is_floating_point(p) else None) for p in prompts)

        prompt_mask = cast_tuple(prompt_mask, num_augment_llms)
        prompt_masks = prompt_mask  # at this point, should be plural
        assert len(prompt_masks) == num_augment_llms

        with torch.no_grad():
            self.augment_llms.eval()
            for augment_llm, mask_kwarg, prompt, prompt_mask in zip(self.augment_llms, self.mask_kwargs, prompts, prompt_masks):
                augment_llm_kwarg = dict()
                if exists(mask_kwarg):
                    augment_llm_kwarg = {mask_kwarg: prompt_mask}
                augment_llm(prompt, **augment_llm_kwarg)

        return prompts, prompt_masks

    @contextmanager
    def set_cross_attn_masks(self, masks):
        for one_cross_attn, mask in zip(self.cross_attns, masks):
            for cross_attn in one_cross_attn:
                cross_attn.set_mask(mask)
        yield
        for one_cross_attn in self.cross_attns:
            for cross_attn in one_cross_attn:
                cross_attn.unset_mask()

    def forward(self, seq, *, prompt, prompt_mask=None, mask=None, return_loss=True):
        if return_loss:
            seq, labels = seq[:, :-1], seq[:, 1:]

        if FIXED:
            prompts, prompt_masks = self.forward_augments(prompt=prompt, prompt_mask=prompt_mask)
            with self.set_cross_attn_masks(prompt_masks):
                logits = self.anchor_llm(seq)
        else:
            self.forward_augments(prompt=prompt, prompt_mask=prompt_mask)

            # set the context mask for the cross attention
            for one_cross_attn in self.cross_attns:
                for cross_attn in one_cross_attn:
                    cross_attn.set_mask(prompt_mask)

            logits = self.anchor_llm(seq)

            # unset the context mask
            for one_cross_attn in self.cross_attns:
                for cross_attn in one_cross_attn:
                    cross_attn.unset_mask()

        if not return_loss:
            return logits

        if exists(mask):
            labels = labels.masked_fill(~mask[:, 1:], self.pad_id)

        return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=self.pad_id)


def main():
    torch.manual_seed(0)
    num_tokens, pad_id = 32, 0

    augment_llm = TransformerWrapper(num_tokens, 16, dim=12, depth=2, causal=False)
    anchor_llm = TransformerWrapper(num_tokens, 16, dim=16, depth=2, causal=True)

    calm = CALM(anchor_llm, augment_llm, pad_id=pad_id, dim=16, dim_augment=12)

    # stand-in for fine-tuned cross attention weights (to_out is zero at init)
    for one_cross_attn in calm.cross_attns:
        for cross_attn in one_cross_attn:
            nn.init.normal_(cross_attn.attn.to_out.weight, std=0.2)

    calm.eval()

    # right-padded prompts for the augment llm
    prompt = torch.tensor([
        [5, 9, 3, 7, 11, 2, 8, 4],
        [6, 13, 4, 0, 0, 0, 0, 0],
    ])
    seq = torch.tensor([
        [1, 14, 15, 16, 17, 18, 19],
        [1, 20, 21, 22, 23, 24, 25],
    ])

    with torch.no_grad():
        logits = calm(seq, prompt=prompt, return_loss=False)
        loss = calm(seq, prompt=prompt, return_loss=True)

    print("logits[1, -1, :6]:", [round(v, 4) for v in logits[1, -1, :6].tolist()])
    print("loss:", round(loss.item(), 5))


if __name__ == "__main__":
    main()
