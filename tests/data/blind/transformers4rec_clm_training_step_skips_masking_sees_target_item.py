# Citation: NVIDIA-Merlin/Transformers4Rec PR #514 ("quick fix: apply masking when training next item
#   prediction"), commit afaff114; bug state read at afaff114^.
# Upstream: transformers4rec/torch/features/sequence.py TabularSequenceFeatures.forward,
#   transformers4rec/torch/masking.py CausalLanguageModeling (MaskSequence.forward, predict_all,
#   apply_mask_to_inputs), transformers4rec/torch/block/transformer.py TransformerBlock.forward + GPT2Prepare,
#   transformers4rec/torch/model/base.py Model.forward / Head.forward,
#   transformers4rec/torch/model/prediction_task.py NextItemPredictionTask.forward (hf_format loss).
# Bug: the training step calls Model.forward(inputs, training=True), and Head.forward defaults to
#   ignore_masking=True, so TabularSequenceFeatures skips the CLM masking module (no shift of the session, no
#   [MASK] embedding) and NextItemPredictionTask takes the "prediction step" branch: it reads the hidden state
#   at each session's last real item and uses that same item as the label. The causal GPT-2 sees the item it
#   is asked to predict.
# Fix: masking is applied when `training` is set (`not ignore_masking or training`), and the task takes its
#   labels from masking.masked_targets during training.
# GPT-2 built from a tiny GPT2Config (random weights); TransformerBlock keeps only the kwargs in the model's
#   forward signature, as upstream does. Sessions are right-padded with item id 0.
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass
class MaskingInfo:
    schema: torch.Tensor
    targets: torch.Tensor


class MaskSequence(nn.Module):
    def __init__(self, hidden_size: int, padding_idx: int = 0, eval_on_last_item_seq_only: bool = True, **kwargs):
        super(MaskSequence, self).__init__()
        self.padding_idx = padding_idx
        self.hidden_size = hidden_size
        self.eval_on_last_item_seq_only = eval_on_last_item_seq_only
        self.mask_schema: Optional[torch.Tensor] = None
        self.masked_targets: Optional[torch.Tensor] = None

        # Create a trainable embedding to replace masked interactions
        self.masked_item_embedding = nn.Parameter(torch.Tensor(self.hidden_size))
        torch.nn.init.normal_(self.masked_item_embedding, mean=0, std=0.001)

    def compute_masked_targets(self, item_ids: torch.Tensor, training=False) -> MaskingInfo:
        assert item_ids.ndim == 2, "`item_ids` must have 2 dimensions."
        masking_info = self._compute_masked_targets(item_ids, training=training)
        self.mask_schema, self.masked_targets = masking_info.schema, masking_info.targets
        return masking_info

    def predict_all(self, item_ids: torch.Tensor) -> MaskingInfo:
        # shift sequence of item-ids
        labels = item_ids[:, 1:]
        labels = torch.cat(
            [labels, torch.zeros((labels.shape[0], 1), dtype=labels.dtype).to(item_ids.device)],
            axis=-1,
        )
        # apply mask on input where target is on padding index
        mask_labels = labels != self.padding_idx
        return MaskingInfo(mask_labels, labels)

    def forward(self, inputs: torch.Tensor, item_ids: torch.Tensor, training=False) -> torch.Tensor:
        _ = self.compute_masked_targets(item_ids=item_ids, training=training)
        if self.mask_schema is None:
            raise ValueError("`mask_schema must be set.`")
        schema: torch.Tensor = self.mask_schema
        return self.apply_mask_to_inputs(inputs, schema)

    def transformer_required_arguments(self) -> Dict[str, Any]:
        return {}

    def transformer_optional_arguments(self) -> Dict[str, Any]:
        return {}

    @property
    def transformer_arguments(self) -> Dict[str, Any]:
        return {**self.transformer_required_arguments(), **self.transformer_optional_arguments()}


class CausalLanguageModeling(MaskSequence):
    def __init__(self, hidden_size: int, padding_idx: int = 0, eval_on_last_item_seq_only: bool = True,
                 train_on_last_item_seq_only: bool = False, **kwargs):
        super(CausalLanguageModeling, self).__init__(
            hidden_size=hidden_size, padding_idx=padding_idx,
            eval_on_last_item_seq_only=eval_on_last_item_seq_only, kwargs=kwargs,
        )
        self.train_on_last_item_seq_only = train_on_last_item_seq_only

    def _compute_masked_targets(self, item_ids: torch.Tensor, training=False) -> MaskingInfo:
        masking_info = self.predict_all(item_ids)
        mask_labels, labels = masking_info.schema, masking_info.targets

        if (self.eval_on_last_item_seq_only and not training) or (self.train_on_last_item_seq_only and training):
            rows_ids = torch.arange(labels.size(0), dtype=torch.long, device=item_ids.device)
            last_item_sessions = mask_labels.sum(dim=1) - 1
            label_seq_trg_eval = torch.zeros(labels.shape, dtype=torch.long, device=item_ids.device)
            label_seq_trg_eval[rows_ids, last_item_sessions] = labels[rows_ids, last_item_sessions]
            labels = label_seq_trg_eval
            mask_labels = label_seq_trg_eval != self.padding_idx

        return MaskingInfo(mask_labels, labels)

    def apply_mask_to_inputs(self, inputs: torch.Tensor, mask_schema: torch.Tensor) -> torch.Tensor:
        # shift sequence of interaction embeddings
        pos_emb_inp = inputs[:, :-1]
        # Adding a masked item in the sequence to return to the initial sequence.
        pos_emb_inp = torch.cat(
            [pos_emb_inp,
             torch.zeros((pos_emb_inp.shape[0], 1, pos_emb_inp.shape[2]), dtype=pos_emb_inp.dtype).to(inputs.device)],
            axis=1,
        )
        # Replacing the inputs corresponding to masked label with a trainable embedding
        pos_emb_inp = torch.where(
            mask_schema.unsqueeze(-1).bool(),
            pos_emb_inp,
            self.masked_item_embedding.to(pos_emb_inp.dtype),
        )
        return pos_emb_inp


class SequenceEmbeddingFeatures(nn.Module):
    def __init__(self, item_id: str, cardinality: int, dim: int, padding_idx: int = 0):
        super().__init__()
        self.item_id = item_id
        self.embedding_tables = nn.ModuleDict({item_id: nn.Embedding(cardinality, dim, padding_idx=padding_idx)})
        self.item_seq: Optional[torch.Tensor] = None

    @property
    def item_embedding_table(self):
        return self.embedding_tables[self.item_id]

    def forward(self, inputs):
        self.item_seq = inputs[self.item_id]
        return {name: table(inputs[name]) for name, table in self.embedding_tables.items()}


class TabularSequenceFeatures(nn.Module):
    def __init__(self, categorical_module, projection_module=None, masking=None):
        super().__init__()
        self.to_merge = nn.ModuleDict({"categorical_module": categorical_module})
        self.projection_module = projection_module
        self.set_masking(masking)

    @property
    def masking(self):
        return self._masking

    def set_masking(self, value):
        self._masking = value

    @property
    def item_id(self):
        return getattr(self.to_merge["categorical_module"], "item_id", None)

    @property
    def categorical_module(self):
        return self.to_merge["categorical_module"]

    def aggregation(self, outputs):
        # "concat" aggregation over the sequential features
        return torch.cat([outputs[name] for name in sorted(outputs)], dim=-1)

    def forward(self, inputs, training=True, ignore_masking=True, **kwargs):
        outputs = {}
        for module in self.to_merge.values():
            outputs.update(module(inputs))

        if self.masking or self.projection_module:
            outputs = self.aggregation(outputs)

        if self.projection_module:
            outputs = self.projection_module(outputs)

        if FIXED:
            apply_masking = self.masking and (not ignore_masking or training)
        else:
            apply_masking = self.masking and not ignore_masking
        if apply_masking:
            outputs = self.masking(outputs, item_ids=self.to_merge["categorical_module"].item_seq, training=training)

        return outputs


class GPT2Prepare(nn.Module):
    def __init__(self, transformer, masking=None):
        super().__init__()
        self.transformer = transformer
        self.masking = masking

    def forward(self, inputs_embeds) -> Dict[str, Any]:
        seq_len = inputs_embeds.shape[1]
        # head_mask has shape n_layer x batch x n_heads x N x N
        head_mask = (
            torch.tril(torch.ones((seq_len, seq_len), dtype=torch.uint8, device=inputs_embeds.device))
            .view(1, 1, 1, seq_len, seq_len)
            .repeat(self.transformer.config.num_hidden_layers, 1, 1, 1, 1)
        )
        return {"inputs_embeds": inputs_embeds, "head_mask": head_mask}


class TransformerBlock(nn.Module):
    def __init__(self, transformer, masking=None, output_fn=lambda model_outputs: model_outputs[0]):
        super().__init__()
        self.transformer = transformer
        self.masking = masking
        self.prepare_module = GPT2Prepare(self.transformer, self.masking)
        self.output_fn = output_fn

    def forward(self, inputs_embeds, **kwargs):
        transformer_kwargs = {"inputs_embeds": inputs_embeds}
        if self.prepare_module:
            transformer_kwargs = self.prepare_module(inputs_embeds)
        if self.masking:
            masking_kwargs = self.masking.transformer_arguments
            if masking_kwargs:
                transformer_kwargs.update(masking_kwargs)

        filtered_transformer_kwargs = {}
        for param in inspect.signature(self.transformer.forward).parameters:
            if param in transformer_kwargs:
                filtered_transformer_kwargs[param] = transformer_kwargs[param]
        model_outputs = self.transformer(**filtered_transformer_kwargs)
        outputs = self.output_fn(model_outputs)
        return outputs


class SequentialBlock(nn.Module):
    def __init__(self, inputs, transformer_block):
        super().__init__()
        self.inputs = inputs
        self.transformer_block = transformer_block

    def forward(self, inputs, training=False, ignore_masking=True, **kwargs):
        x = self.inputs(inputs, training=training, ignore_masking=ignore_masking)
        return self.transformer_block(x)


class _NextItemPredictionTask(nn.Module):
    def __init__(self, input_size, target_dim, weight_tying=False, item_embedding_table=None, softmax_temperature=0):
        super().__init__()
        self.input_size = input_size
        self.target_dim = target_dim
        self.weight_tying = weight_tying
        self.item_embedding_table = item_embedding_table
        self.softmax_temperature = softmax_temperature
        self.log_softmax = nn.LogSoftmax(dim=-1)
        self.output_layer_bias = nn.Parameter(torch.Tensor(self.target_dim))
        torch.nn.init.zeros_(self.output_layer_bias)

    def forward(self, inputs: torch.Tensor, **kwargs) -> torch.Tensor:
        logits = torch.nn.functional.linear(inputs, weight=self.item_embedding_table.weight,
                                            bias=self.output_layer_bias)
        if self.softmax_temperature:
            logits = torch.div(logits, self.softmax_temperature)
        return self.log_softmax(logits)


class NextItemPredictionTask(nn.Module):
    def __init__(self, inputs: TabularSequenceFeatures, weight_tying=True, softmax_temperature=1,
                 padding_idx=0, hf_format=True):
        super().__init__()
        self.loss = nn.NLLLoss(ignore_index=0)
        self.hf_format = hf_format
        self.embeddings = inputs.categorical_module
        self.target_dim = self.embeddings.item_embedding_table.num_embeddings
        self.masking = inputs.masking
        self.padding_idx = self.masking.padding_idx
        self.task_block = None
        self.pre = _NextItemPredictionTask(
            inputs, self.target_dim, weight_tying, self.embeddings.item_embedding_table, softmax_temperature
        )

    def forward(self, inputs: torch.Tensor, ignore_masking=True, training=False, **kwargs):
        if isinstance(inputs, (tuple, list)):
            inputs = inputs[0]
        x = inputs.float()

        if self.task_block:
            x = self.task_block(x)

        # Retrieve labels from masking
        use_masking_labels = (training or not ignore_masking) if FIXED else (not ignore_masking)
        if use_masking_labels:
            labels = self.masking.masked_targets
            trg_flat = labels.flatten()
            non_pad_mask = trg_flat != self.padding_idx
            labels_all = torch.masked_select(trg_flat, non_pad_mask)
            # remove padded items, keep only masked positions
            x = self.remove_pad_3d(x, non_pad_mask)
        else:
            # keep only last non-padded position for the 'Prediction step'
            labels = self.embeddings.item_seq
            non_pad_mask = labels != self.padding_idx
            last_item_sessions = non_pad_mask.sum(dim=1) - 1
            rows_ids = torch.arange(labels.size(0), dtype=torch.long, device=labels.device)
            labels_all = labels[rows_ids, last_item_sessions]
            labels_all = labels_all.flatten()
            x = x[rows_ids, last_item_sessions]

        # Compute predictions probs
        x = self.pre(x)

        if self.hf_format:
            loss = self.loss(x, labels_all)
            return {"loss": loss, "labels": labels_all, "predictions": x}
        return x

    def remove_pad_3d(self, inp_tensor, non_pad_mask):
        inp_tensor = inp_tensor.flatten(end_dim=1)
        inp_tensor_fl = torch.masked_select(inp_tensor, non_pad_mask.unsqueeze(1).expand_as(inp_tensor))
        out_tensor = inp_tensor_fl.view(-1, inp_tensor.size(1))
        return out_tensor


class Head(nn.Module):
    def __init__(self, body, task):
        super().__init__()
        self.body = body
        self.prediction_task_dict = nn.ModuleDict({"next-item": task})

    def forward(self, body_outputs, training=True, call_body=False, always_output_dict=False,
                ignore_masking=True, **kwargs):
        outputs = {}
        if call_body:
            body_outputs = self.body(body_outputs, training=training, ignore_masking=ignore_masking)

        for name, task in self.prediction_task_dict.items():
            if FIXED:
                outputs[name] = task(body_outputs, ignore_masking=ignore_masking, training=training, **kwargs)
            else:
                outputs[name] = task(body_outputs, ignore_masking=ignore_masking, **kwargs)

        if len(outputs) == 1 and not always_output_dict:
            return outputs[list(outputs.keys())[0]]
        return outputs


class Model(nn.Module):
    def __init__(self, *head):
        super().__init__()
        self.heads = nn.ModuleList(head)

    def forward(self, inputs, training=True, **kwargs):
        outputs = {}
        for head in self.heads:
            outputs.update(head(inputs, call_body=True, training=training, always_output_dict=True, **kwargs))
        if len(outputs) == 1:
            return outputs[list(outputs.keys())[0]]
        return outputs


# ---- a tiny session-based next-item model, as the T4Rec examples build it ----
d_model, n_items, max_len = 32, 40, 8
masking = CausalLanguageModeling(hidden_size=d_model, padding_idx=0)
input_module = TabularSequenceFeatures(
    SequenceEmbeddingFeatures("item_id-list_seq", n_items, d_model),
    projection_module=nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU()),
    masking=masking,
)
gpt2 = GPT2Model(GPT2Config(n_embd=d_model, n_layer=2, n_head=4, n_positions=max_len, vocab_size=n_items,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=None, eos_token_id=None))
body = SequentialBlock(input_module, TransformerBlock(gpt2, masking=masking))
model = Model(Head(body, NextItemPredictionTask(input_module, weight_tying=True, hf_format=True)))

# right-padded sessions (padding item id 0)
sessions = [[5, 9, 12, 7, 3], [8, 8, 21], [14, 2, 30, 6, 11, 19, 4], [17, 25]]
batch = torch.zeros(len(sessions), max_len, dtype=torch.long)
for i, s in enumerate(sessions):
    batch[i, : len(s)] = torch.tensor(s)
inputs = {"item_id-list_seq": batch}

# the trainer's training step: model(inputs, training=True) and the "loss" entry
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
model.train()
for step in range(5):
    out = model(inputs, training=True)
    loss = out["loss"]
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: train loss {loss.item():.4f} on {out['labels'].numel()} targets")

# evaluation: last-item prediction through the masking schema (as calculate_metrics does)
model.eval()
with torch.no_grad():
    out = model(inputs, training=False, ignore_masking=False)
    preds = out["predictions"].argmax(-1)
print("eval labels     :", out["labels"].tolist())
print("eval top-1 items:", preds.tolist())
print(f"eval loss {out['loss'].item():.4f}")
