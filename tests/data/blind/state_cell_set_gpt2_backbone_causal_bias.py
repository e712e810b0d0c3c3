"""Arc Institute State: a cell *set* was encoded by a stock GPT2 backbone, i.e. causally.

Citation: ArcInstitute/state PR #62 ("bidirectional-fix", merge 6d4857b; commit 3ca29fa "Update
utils.py so backbones use bidirectional wrapper").  Source read: src/state_sets/sets/models/
utils.py (`get_transformer_backbone`) and pert_sets.py (`PertSetsPerturbationModel.forward`) at
3ca29fa^ and the diff of 3ca29fa.

Bug: the perturbation model treats each "cell sentence" of `cell_set_len` control cells as an
unordered set — `get_transformer_backbone` even zeroes and freezes GPT2's position embeddings —
yet it instantiated a plain `GPT2Model(config)`, whose attention keeps the lower-triangular
`attn.bias` buffer: cell i only sees cells 0..i, so predictions depend on the arbitrary order.
Fix (3ca29fa): `GPT2BidirectionalModel`, which fills every block's `attn.bias` with True (and
sets `is_causal = False`, `config.is_decoder = False`).

Reproduction: GPT2-style backbone written in torch (eager attention with the registered `bias`
buffer and `torch.where(causal_mask, w, mask_value)` as in HF GPT2Attention._attn), zeroed and
frozen `wpe`, driven by PertSetsPerturbationModel.forward on 2 sets of 8 cells.  The config is a
small dict standing for `transformer_backbone_kwargs` (transformers' import alone exceeds this
program's time budget).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class GPT2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config["n_positions"]
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions),
            persistent=False,
        )
        self.embed_dim = config["n_embd"]
        self.num_heads = config["n_head"]
        self.head_dim = self.embed_dim // self.num_heads
        self.is_causal = True
        self.c_attn = nn.Linear(self.embed_dim, 3 * self.embed_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) / (value.size(-1) ** 0.5)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length: key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        split = lambda t: t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        attn_output = self._attn(split(query), split(key), split(value))
        return self.c_proj(attn_output.transpose(1, 2).flatten(-2))


class GPT2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config["n_embd"])
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config["n_embd"])
        self.mlp = nn.Sequential(nn.Linear(config["n_embd"], 4 * config["n_embd"]), nn.GELU(),
                                 nn.Linear(4 * config["n_embd"], config["n_embd"]))

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wpe = nn.Embedding(config["n_positions"], config["n_embd"])
        self.h = nn.ModuleList([GPT2Block(config) for _ in range(config["n_layer"])])
        self.ln_f = nn.LayerNorm(config["n_embd"])

    def forward(self, inputs_embeds):
        position_ids = torch.arange(inputs_embeds.shape[1])[None]
        hidden_states = inputs_embeds + self.wpe(position_ids)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2BidirectionalModel(GPT2Model):
    """A thin wrapper around GPT2Model that disables the causal (unidirectional) mask."""

    def __init__(self, config):
        config["is_decoder"] = False
        super().__init__(config)
        # Overwrite each attention's bias so no triangular masking occurs.
        for block in self.h:
            block.attn.bias.data.fill_(True)
            block.attn.is_causal = False


def get_transformer_backbone(key, kwargs):
    if key == "GPT2":
        config = dict(kwargs)
        model = GPT2BidirectionalModel(config) if FIXED else GPT2Model(config)

        # Zero out position embeddings and freeze them
        model.wpe.weight.requires_grad = False
        model.wpe.weight.zero_()
        model_dim = config["n_embd"]
    else:
        raise ValueError(f"Unknown backbone key {key}")
    return model, model_dim


class PertSetsPerturbationModel(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, pert_dim, transformer_backbone_key="GPT2",
                 transformer_backbone_kwargs=None, **kwargs):
        super().__init__()
        self.input_dim, self.pert_dim, self.output_dim = input_dim, pert_dim, output_dim
        self.cell_sentence_len = kwargs.get("cell_set_len", 256)
        self.transformer_backbone_kwargs = dict(transformer_backbone_kwargs)
        self.transformer_backbone_kwargs["n_positions"] = self.cell_sentence_len + kwargs.get("extra_tokens", 0)
        self.pert_encoder = nn.Sequential(nn.Linear(pert_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim))
        self.basal_encoder = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.GELU(),
                                           nn.Linear(hidden_dim, hidden_dim))
        self.transformer_backbone, self.transformer_model_dim = get_transformer_backbone(
            transformer_backbone_key, self.transformer_backbone_kwargs)
        self.project_out = nn.Linear(hidden_dim, output_dim)

    def forward(self, batch: dict, padded=True) -> torch.Tensor:
        if padded:
            pert = batch["pert_emb"].reshape(-1, self.cell_sentence_len, self.pert_dim)
            basal = batch["ctrl_cell_emb"].reshape(-1, self.cell_sentence_len, self.input_dim)
        else:
            pert = batch["pert_emb"].reshape(1, -1, self.pert_dim)
            basal = batch["ctrl_cell_emb"].reshape(1, -1, self.input_dim)
        seq_input = self.pert_encoder(pert) + self.basal_encoder(basal)  # [B, S, hidden_dim]
        transformer_output = self.transformer_backbone(inputs_embeds=seq_input)
        return self.project_out(transformer_output) + basal  # predict_residual


if __name__ == "__main__":
    torch.manual_seed(0)
    model = PertSetsPerturbationModel(
        input_dim=16, hidden_dim=32, output_dim=16, pert_dim=8, cell_set_len=8,
        transformer_backbone_kwargs={"n_embd": 32, "n_head": 4, "n_layer": 2}).eval()
    batch = {"pert_emb": torch.randn(16, 8), "ctrl_cell_emb": torch.randn(16, 16)}
    with torch.no_grad():
        pred = model(batch)
        flipped = model({k: v.reshape(2, 8, -1).flip(1).reshape(16, -1) for k, v in batch.items()})
    order_effect = (pred - flipped.flip(1)).abs().max().item()
    print(f"max change of a cell's prediction when the set is reversed: {order_effect:.4f}")
