# ArcInstitute/state#227 ("Fix bidirectional attention in Llama backbone", merged 2025-10-01; fix as the PR
# description states it, diff not read). State's perturbation model (src/state/tx/models/) encodes a *set* of cells
# with a Llama backbone, `LlamaBidirectionalModel` in src/state/tx/models/utils.py, which meant to turn causal
# masking off by overriding `_update_causal_mask` to return None and passing `is_causal=False`. LlamaModel no longer
# calls `_update_causal_mask` (it calls masking_utils.create_causal_mask), so the override is dead code and every cell
# of the set attends only to the cells before it. The project's forward also passed `is_causal=False` as a kwarg; under
# the transformers it then ran on (4.5x) create_causal_mask never read it and eager attention ignores it, while
# transformers 5 reads it, so this port leaves that kwarg out to run the project's behaviour of the time.
# Fix: hand the backbone an attention mask of ones, which create_causal_mask passes through as-is, so all cells of
# the set attend to each other.
import sys

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaModel

FIXED = "--fixed" in sys.argv


class NoRoPE(nn.Module):
    """cos = ones, sin = zeros: rotary has no effect (cells of a set have no order)."""

    def __init__(self, num_attention_heads: int, hidden_size: int):
        super().__init__()
        self.num_heads = num_attention_heads
        self.hidden_size = hidden_size

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.LongTensor):
        batch_size, seq_len, hidden_dim = hidden_states.shape
        cos = hidden_states.new_ones(batch_size, seq_len, self.num_heads)
        sin = hidden_states.new_zeros(batch_size, seq_len, self.num_heads)
        return cos, sin


class LlamaBidirectionalModel(LlamaModel):
    """
    A drop-in replacement for LlamaModel with bidirectional attention.
    By overriding _update_causal_mask to return None, all tokens attend to each other.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        self.rotary_emb = NoRoPE(num_attention_heads=config.head_dim, hidden_size=config.hidden_size)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_key_values, output_attentions=False):
        # By returning None, we disable any causal-(look-ahead) masking.
        return None

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **flash_attn_kwargs):
        if FIXED and attention_mask is None:
            # an attention mask of ones: every cell of the set sees every other cell
            bsz, seq_len = inputs_embeds.shape[:2]
            attention_mask = torch.ones(bsz, 1, seq_len, seq_len, dtype=torch.bool, device=inputs_embeds.device)
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **flash_attn_kwargs,
        )


def get_transformer_backbone(key, kwargs):
    if key == "llama":
        config = LlamaConfig(**kwargs)
        model = LlamaBidirectionalModel(config)
        model_dim = config.hidden_size
        model.embed_tokens.weight.requires_grad = False
        model.embed_tokens.weight.zero_()
    else:
        raise ValueError(f"Unknown backbone key {key}")
    return model, model_dim


class PertSetsPerturbationModel(nn.Module):
    """Trimmed: control cells + perturbation -> predicted perturbed expression for the whole cell set."""

    def __init__(self, input_dim, hidden_dim, pert_dim, output_dim, cell_set_len, transformer_backbone_kwargs):
        super().__init__()
        self.cell_sentence_len = cell_set_len
        self.pert_encoder = nn.Sequential(nn.Linear(pert_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim))
        self.basal_encoder = nn.Linear(input_dim, hidden_dim)
        self.transformer_backbone, self.transformer_model_dim = get_transformer_backbone("llama", transformer_backbone_kwargs)
        self.project_out = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, output_dim))

    def forward(self, batch):
        pert = batch["pert_emb"].reshape(-1, self.cell_sentence_len, batch["pert_emb"].shape[-1])
        basal = batch["ctrl_cell_emb"].reshape(-1, self.cell_sentence_len, batch["ctrl_cell_emb"].shape[-1])
        seq_input = self.pert_encoder(pert) + self.basal_encoder(basal)  # (B, S, H)
        res_pred = self.transformer_backbone(inputs_embeds=seq_input).last_hidden_state
        out_pred = self.project_out(res_pred) + basal
        return out_pred.reshape(-1, out_pred.shape[-1])


def main():
    torch.manual_seed(0)
    S, G, P, H = 6, 16, 8, 32
    backbone_kwargs = dict(
        hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, vocab_size=32, max_position_embeddings=S, initializer_range=0.3, attn_implementation="eager",
    )
    model = PertSetsPerturbationModel(G, H, P, G, S, backbone_kwargs).eval()

    B = 2
    ctrl = torch.randn(B * S, G)
    pert = torch.zeros(B * S, P)
    pert[:S, 1] = 1.0
    pert[S:, 5] = 1.0
    with torch.no_grad():
        pred = model({"ctrl_cell_emb": ctrl, "pert_emb": pert})
        # the same sets, their cells listed in reverse order
        order = torch.cat([torch.arange(S - 1, -1, -1), S + torch.arange(S - 1, -1, -1)])
        pred_rev = model({"ctrl_cell_emb": ctrl[order], "pert_emb": pert[order]})

    target = ctrl + 0.5
    loss = nn.functional.mse_loss(pred, target)
    print("pred[0, :4]       ", [round(v, 4) for v in pred[0, :4].tolist()])
    print("pred set-mean     ", [round(v, 4) for v in pred[:S].mean(0)[:4].tolist()])
    print("mse loss           %.6f" % loss.item())
    print("order change (max) %.6f" % (pred - pred_rev[order]).abs().max().item())


if __name__ == "__main__":
    main()
