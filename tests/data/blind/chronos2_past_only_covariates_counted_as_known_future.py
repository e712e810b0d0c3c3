# amazon-science/chronos-forecasting#344 (commit 6c69155, closes #345): Chronos-2's
# validate_and_prepare_single_dict_task returned task_n_future_covariates = len(task_future_covariates_list), a list
# built over every past_covariates key, so Chronos2Dataset._construct_slice counted past-only covariates as known
# future ones: their true future values were sliced into future_covariates instead of the NaNs whose mask hides them,
# and the target's future patches read them through group attention in training/validation. The fix counts only the
# future_covariates keys and orders past-only keys before known-future ones.
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)


# ---------------------------------------------------------------- src/chronos/chronos2/dataset.py
def validate_and_prepare_single_dict_task(task, idx, prediction_length):
    task_target = torch.as_tensor(task["target"], dtype=torch.float32)
    if task_target.ndim == 1:
        task_target = task_target.unsqueeze(0)
    history_length = task_target.shape[-1]
    task_past_covariates = task.get("past_covariates", {})
    task_covariates_keys = sorted(task_past_covariates.keys())
    task_future_covariates = task.get("future_covariates", {})
    task_future_covariates_keys = sorted(task_future_covariates.keys())
    if FIXED:
        # create ordered keys: past-only first, then known-future (so known-future are the last rows)
        task_past_only_keys = [k for k in task_covariates_keys if k not in task_future_covariates_keys]
        task_ordered_covariate_keys = task_past_only_keys + task_future_covariates_keys
    else:
        task_ordered_covariate_keys = task_covariates_keys

    task_past_covariates_list = []
    for key in task_ordered_covariate_keys:
        tensor = torch.as_tensor(task_past_covariates[key], dtype=torch.float32)
        assert tensor.shape == (history_length,)
        task_past_covariates_list.append(tensor)
    task_past_covariates_tensor = (
        torch.stack(task_past_covariates_list, dim=0)
        if task_past_covariates_list
        else torch.zeros((0, history_length))
    )
    task_future_covariates_list = []
    for key in task_ordered_covariate_keys:
        # future values of past-only covariates are filled with NaNs
        tensor = task_future_covariates.get(key, torch.full((prediction_length,), fill_value=torch.nan))
        task_future_covariates_list.append(torch.as_tensor(tensor, dtype=torch.float32))
    task_future_covariates_tensor = (
        torch.stack(task_future_covariates_list, dim=0)
        if task_future_covariates_list
        else torch.zeros((0, prediction_length))
    )
    task_context_tensor = torch.cat([task_target, task_past_covariates_tensor], dim=0)
    task_future_tensor = torch.cat(
        [torch.full((task_target.shape[0], prediction_length), fill_value=torch.nan), task_future_covariates_tensor],
        dim=0,
    )
    task_n_targets = task_target.shape[0]
    task_n_covariates = task_past_covariates_tensor.shape[0]
    if FIXED:
        # number of known-future covariates
        task_n_future_covariates = len(task_future_covariates_keys)
    else:
        task_n_future_covariates = len(task_future_covariates_list)
    return task_context_tensor, task_future_tensor, task_n_targets, task_n_covariates, task_n_future_covariates


class Chronos2Dataset:
    def __init__(self, inputs, context_length, prediction_length):
        self.context_length = context_length
        self.prediction_length = prediction_length
        self.mode = "validation"
        self.tasks = [validate_and_prepare_single_dict_task(t, i, prediction_length) for i, t in enumerate(inputs)]

    def _construct_slice(self, task_idx):
        (task_past_tensor, task_future_tensor, task_n_targets, task_n_covariates,
         task_n_future_covariates) = self.tasks[task_idx]
        task_n_past_only_covariates = task_n_covariates - task_n_future_covariates
        full_length = task_past_tensor.shape[-1]
        # slice the last window for validation
        slice_idx = full_length - self.prediction_length
        task_context = task_past_tensor[:, max(0, slice_idx - self.context_length): slice_idx]

        task_future_target = task_past_tensor[:, slice_idx: slice_idx + self.prediction_length]
        if task_n_future_covariates > 0:
            # the last task_n_future_covariates elements in task_context_tensor are the known covariates
            task_future_covariates = task_past_tensor[
                -task_n_future_covariates:, slice_idx: slice_idx + self.prediction_length
            ]
        else:
            task_future_covariates = torch.zeros((0, self.prediction_length))
        # the leading task_n_targets + task_n_past_only_covariates elements are masked because the target(s)
        # and past-only covariates are not known into the future
        task_future_covariates_padding = torch.full(
            (task_n_targets + task_n_past_only_covariates, self.prediction_length), fill_value=torch.nan
        )
        task_future_covariates = torch.cat([task_future_covariates_padding, task_future_covariates], dim=0)
        return task_context, task_future_target, task_future_covariates, task_n_targets

    def _build_batch(self, task_indices):
        ctx, fut_t, fut_c, group_ids, target_idx_ranges = [], [], [], [], []
        row = 0
        for group_id, task_idx in enumerate(task_indices):
            task_context, task_future_target, task_future_covariates, task_n_targets = self._construct_slice(task_idx)
            ctx.append(task_context)
            fut_c.append(task_future_covariates)
            # future values of covariates are ignored in the loss
            task_future_target = task_future_target.clone()
            task_future_target[task_n_targets:] = torch.nan
            fut_t.append(task_future_target)
            group_ids.append(torch.full((task_context.shape[0],), group_id))
            target_idx_ranges.append((row, row + task_n_targets))
            row += task_context.shape[0]
        return {
            "context": torch.cat(ctx), "future_target": torch.cat(fut_t), "future_covariates": torch.cat(fut_c),
            "group_ids": torch.cat(group_ids), "target_idx_ranges": target_idx_ranges,
        }


# ---------------------------------------------------------------- src/chronos/chronos2/{config,layers,model}.py
class Chronos2CoreConfig:
    d_model, d_ff, num_heads, num_layers = 32, 64, 4, 2
    context_length, input_patch_size, output_patch_size = 32, 4, 4
    max_output_patches, time_encoding_scale = 4, 32
    quantiles = [0.1, 0.5, 0.9]


class MHA(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads, self.d_kv = config.num_heads, config.d_model // config.num_heads
        self.q = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v = nn.Linear(config.d_model, config.d_model, bias=False)
        self.o = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, hidden_states, mask):
        b, t, _ = hidden_states.shape
        q, k, v = (lin(hidden_states).view(b, t, self.n_heads, self.d_kv).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(3, 2)) + mask
        attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(b, t, -1)
        return self.o(out)


class TimeSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attention = MHA(config)
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, attention_mask):
        return hidden_states + self.self_attention(self.layer_norm(hidden_states), mask=attention_mask)


class GroupSelfAttention(nn.Module):
    """Self-attention applied along the batch axis masked by the group attention mask"""

    def __init__(self, config):
        super().__init__()
        self.self_attention = MHA(config)
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, attention_mask):
        # flip time and batch axes because attention operates along dim=-2
        hidden_states = hidden_states.transpose(0, 1)
        hidden_states = hidden_states + self.self_attention(self.layer_norm(hidden_states), mask=attention_mask)
        return hidden_states.transpose(0, 1)


class Chronos2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.chronos_config = config
        p = config.input_patch_size
        # x3 for [time_embedding, patch, patch_mask]
        self.input_patch_embedding = nn.Sequential(nn.Linear(3 * p, config.d_ff), nn.ReLU(),
                                                   nn.Linear(config.d_ff, config.d_model))
        self.time_attn = nn.ModuleList([TimeSelfAttention(config) for _ in range(config.num_layers)])
        self.group_attn = nn.ModuleList([GroupSelfAttention(config) for _ in range(config.num_layers)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.LayerNorm(config.d_model), nn.Linear(config.d_model, config.d_ff),
                                                nn.ReLU(), nn.Linear(config.d_ff, config.d_model))
                                  for _ in range(config.num_layers)])
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.output_patch_embedding = nn.Linear(config.d_model, len(config.quantiles) * config.output_patch_size)

    @staticmethod
    def instance_norm(x, loc_scale=None):
        if loc_scale is None:
            loc = torch.nan_to_num(torch.nanmean(x, dim=-1, keepdim=True), nan=0.0)
            scale = torch.nan_to_num(torch.nanmean((x - loc).square(), dim=-1, keepdim=True).sqrt(), nan=1.0)
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
            loc_scale = (loc, scale)
        loc, scale = loc_scale
        return (x - loc) / scale, loc_scale

    def patch(self, x):
        return x.unfold(-1, self.chronos_config.input_patch_size, self.chronos_config.input_patch_size)

    def _prepare_patched_context(self, context):
        context_mask = torch.isnan(context).logical_not().to(context.dtype)
        context, loc_scale = self.instance_norm(context)
        patched_context = self.patch(context)
        patched_mask = torch.nan_to_num(self.patch(context_mask), nan=0.0)
        patched_context = torch.where(patched_mask > 0.0, patched_context, 0.0)
        # attention_mask = 1 if at least one item in the patch is observed
        attention_mask = patched_mask.sum(dim=-1) > 0
        n = attention_mask.shape[-1]
        p = self.chronos_config.input_patch_size
        time_enc = torch.arange(-n * p, 0, dtype=torch.float32).view(1, n, p).expand(context.shape[0], -1, -1)
        time_enc = time_enc / self.chronos_config.time_encoding_scale
        return torch.cat([time_enc, patched_context, patched_mask], dim=-1), attention_mask, loc_scale

    def _prepare_patched_future(self, future_covariates, loc_scale, num_output_patches):
        p = self.chronos_config.output_patch_size
        future_covariates, _ = self.instance_norm(future_covariates, loc_scale)
        future_covariates_mask = torch.isnan(future_covariates).logical_not().to(future_covariates.dtype)
        future_covariates = torch.where(future_covariates_mask > 0.0, future_covariates, 0.0)
        b = future_covariates.shape[0]
        patched = future_covariates.view(b, num_output_patches, p)
        patched_mask = future_covariates_mask.view(b, num_output_patches, p)
        time_enc = torch.arange(0, num_output_patches * p, dtype=torch.float32).view(1, num_output_patches, p)
        time_enc = time_enc.expand(b, -1, -1) / self.chronos_config.time_encoding_scale
        return torch.cat([time_enc, patched, patched_mask], dim=-1), patched_mask

    def forward(self, context, group_ids, future_covariates, future_target=None, num_output_patches=2):
        patched_context, attention_mask, loc_scale = self._prepare_patched_context(context)
        patched_future, patched_future_covariates_mask = self._prepare_patched_future(
            future_covariates, loc_scale, num_output_patches)
        future_attention_mask = torch.ones(context.shape[0], num_output_patches, dtype=torch.bool)
        input_embeds = self.input_patch_embedding(torch.cat([patched_context, patched_future], dim=1))
        attention_mask = torch.cat([attention_mask, future_attention_mask], dim=1).to(input_embeds.dtype)

        # time mask (batch, 1, 1, kv) and group-time mask (time, 1, q, b), both inverted to additive floats
        extended_attention_mask = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(input_embeds.dtype).min
        group_mask = group_ids[:, None] == group_ids[None, :]
        group_time_mask = torch.einsum("qb, bt -> qbt", group_mask.to(attention_mask.dtype), attention_mask)
        group_time_mask = group_time_mask.permute(2, 0, 1).unsqueeze(1)
        group_time_mask = (1.0 - group_time_mask) * torch.finfo(input_embeds.dtype).min

        hidden_states = input_embeds
        for time_attn, group_attn, ffn in zip(self.time_attn, self.group_attn, self.ffn):
            hidden_states = time_attn(hidden_states, extended_attention_mask)
            hidden_states = group_attn(hidden_states, group_time_mask)
            hidden_states = hidden_states + ffn(hidden_states)
        hidden_states = self.final_layer_norm(hidden_states)

        q = len(self.chronos_config.quantiles)
        future_hidden = hidden_states[:, -num_output_patches:]
        quantile_preds = self.output_patch_embedding(future_hidden)
        quantile_preds = quantile_preds.view(context.shape[0], num_output_patches, q, -1)
        quantile_preds = quantile_preds.permute(0, 2, 1, 3).reshape(context.shape[0], q, -1)

        loss = None
        if future_target is not None:
            future_target, _ = self.instance_norm(future_target, loc_scale)
            future_target = future_target.unsqueeze(1)
            future_target_mask = ~torch.isnan(future_target)
            future_target = torch.nan_to_num(future_target, nan=0.0)
            quantiles = torch.tensor(self.chronos_config.quantiles).view(1, -1, 1)
            diff = future_target - quantile_preds
            loss = (torch.abs(diff) * ((future_target <= quantile_preds).float() - quantiles)).abs()
            loss = (loss * future_target_mask).sum() / future_target_mask.sum().clamp_min(1)
        # un-scale
        loc, scale = loc_scale
        return loss, quantile_preds * scale.unsqueeze(1) + loc.unsqueeze(1)


# --------------------------------------------------------------------------- a fine-tuning run on dict inputs
PRED_LEN, HIST = 8, 40
t = np.arange(HIST, dtype=np.float32)
inputs = []
for i in range(3):
    promo = (np.random.rand(HIST) < 0.3).astype(np.float32)  # known in advance
    sales = 10 + 3 * np.sin(t / 4 + i) + 4 * promo + np.random.randn(HIST).astype(np.float32) * 0.3
    visitors = sales * 2.0 + np.random.randn(HIST).astype(np.float32)  # observed only as it happens
    inputs.append({
        "target": sales,
        "past_covariates": {"promo": promo, "visitors": visitors},
        "future_covariates": {"promo": promo[-PRED_LEN:]},
    })

config = Chronos2CoreConfig()
dataset = Chronos2Dataset(inputs, context_length=config.context_length, prediction_length=PRED_LEN)
batch = dataset._build_batch([0, 1, 2])
model = Chronos2Model(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
for step in range(40):
    loss, preds = model(batch["context"], batch["group_ids"], batch["future_covariates"], batch["future_target"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 10 == 0 or step == 39:
        print(f"fixed={FIXED} step {step:2d} quantile loss {loss.item():.4f}")
median = preds[:, 1]
for s, e in batch["target_idx_ranges"][:1]:
    print("median forecast of series 0:", [round(v, 2) for v in median[s].tolist()])
