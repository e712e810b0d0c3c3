# Citation: NVIDIA-Merlin/Transformers4Rec PR #723 ("Fix the CLM performance mismatch between evaluation and
#   manual inference", fixes #719), commit f3c4d2a6 ("fix of clm performance"); bug state read at f3c4d2a6^.
# Upstream: transformers4rec/torch/masking.py CausalLanguageModeling._compute_masked_targets /
#   apply_mask_to_inputs (MaskSequence.forward, predict_all), transformers4rec/torch/block/transformer.py
#   TransformerBlock.forward + GPT2Prepare, transformers4rec/torch/model/prediction_task.py
#   NextItemPredictionTask.forward (testing branch, remove_pad_3d).
# Bug: with eval_on_last_item_seq_only=True, the CLM evaluation schema (the per-item mask that decides which
#   input positions keep their interaction embedding and which are replaced by the trainable [MASK] embedding)
#   was built from the last-item label tensor: `mask_labels = label_seq_trg_eval != padding_idx` is True at one
#   position per session, so every earlier real item of the session is hidden from the causal transformer
#   (replaced by [MASK]) and the last-item prediction sees almost no history.
# Fix: `mask_labels = item_ids != self.padding_idx`: only padded positions are replaced (and at inference the
#   padded positions are replaced by the [MASK] embedding too).
# GPT-2 built from a tiny GPT2Config (random weights); TransformerBlock keeps only the kwargs in the model's
#   forward signature, as upstream does.
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

    def compute_masked_targets(self, item_ids, training=False, testing=False) -> MaskingInfo:
        assert item_ids.ndim == 2, "`item_ids` must have 2 dimensions."
        masking_info = self._compute_masked_targets(item_ids, training=training, testing=testing)
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

    def forward(self, inputs, item_ids, training=False, testing=False):
        _ = self.compute_masked_targets(item_ids=item_ids, training=training, testing=testing)
        if self.mask_schema is None:
            raise ValueError("`mask_schema must be set.`")
        schema: torch.Tensor = self.mask_schema
        return self.apply_mask_to_inputs(inputs, schema, training=training, testing=testing)

    def transformer_required_arguments(self) -> Dict[str, Any]:
        return {}

    def transformer_optional_arguments(self) -> Dict[str, Any]:
        return {}

    @property
    def transformer_arguments(self) -> Dict[str, Any]:
        return {**self.transformer_required_arguments(), **self.transformer_optional_arguments()}


class CausalLanguageModeling(MaskSequence):
    def __init__(self, hidden_size, padding_idx=0, eval_on_last_item_seq_only=True,
                 train_on_last_item_seq_only=False, **kwargs):
        super(CausalLanguageModeling, self).__init__(
            hidden_size=hidden_size, padding_idx=padding_idx,
            eval_on_last_item_seq_only=eval_on_last_item_seq_only, kwargs=kwargs,
        )
        self.train_on_last_item_seq_only = train_on_last_item_seq_only

    def _compute_masked_targets(self, item_ids, training=False, testing=False) -> MaskingInfo:
        if FIXED and not training and not testing:
            mask_labels = item_ids != self.padding_idx
            return MaskingInfo(mask_labels, item_ids)

        masking_info = self.predict_all(item_ids)
        mask_labels, labels = masking_info.schema, masking_info.targets

        if (self.eval_on_last_item_seq_only and not training) or (
            self.train_on_last_item_seq_only and training
        ):
            rows_ids = torch.arange(labels.size(0), dtype=torch.long, device=item_ids.device)
            last_item_sessions = mask_labels.sum(dim=1) - 1
            label_seq_trg_eval = torch.zeros(labels.shape, dtype=labels.dtype, device=item_ids.device)
            label_seq_trg_eval[rows_ids, last_item_sessions] = labels[rows_ids, last_item_sessions]
            # Updating labels and mask
            labels = label_seq_trg_eval
            if FIXED:
                # We only mask padded positions
                mask_labels = item_ids != self.padding_idx
            else:
                mask_labels = label_seq_trg_eval != self.padding_idx

        return MaskingInfo(mask_labels, labels)

    def apply_mask_to_inputs(self, inputs, mask_schema, training=False, testing=False):
        if not training and not testing:
            if FIXED:
                inputs = torch.where(
                    mask_schema.unsqueeze(-1).bool(), inputs, self.masked_item_embedding.to(inputs.dtype)
                )
            return inputs
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
        self.prepare_module = GPT2Prepare(transformer, masking)
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
        return self.output_fn(model_outputs)


class NextItemPredictionTask(nn.Module):
    def __init__(self, masking, item_embedding_table, softmax_temperature=1.0):
        super().__init__()
        self.masking = masking
        self.padding_idx = masking.padding_idx
        self.item_embedding_table = item_embedding_table
        self.softmax_temperature = softmax_temperature
        self.loss = nn.CrossEntropyLoss()

    def pre(self, x):
        # NextItemPredictionPrepareBlock with weight tying
        logits = torch.matmul(x, self.item_embedding_table.weight.t())
        return logits / self.softmax_temperature

    def remove_pad_3d(self, inp_tensor, non_pad_mask):
        inp_tensor = inp_tensor.flatten(end_dim=1)
        inp_tensor_fl = torch.masked_select(inp_tensor, non_pad_mask.unsqueeze(1).expand_as(inp_tensor))
        return inp_tensor_fl.view(-1, inp_tensor.size(1))

    def forward(self, inputs, training=False, testing=False):
        x = inputs.float()
        if training or testing:
            labels = self.masking.masked_targets
            trg_flat = labels.flatten()
            non_pad_mask = trg_flat != self.padding_idx
            labels_all = torch.masked_select(trg_flat, non_pad_mask).long()
            # remove padded items, keep only masked positions
            x = self.remove_pad_3d(x, non_pad_mask)
            y = labels_all
            x = self.pre(x)
            loss = self.loss(x, y)
            return {"loss": loss, "labels": y, "predictions": x}
        raise RuntimeError("inference branch not used here")


def main():
    n_items, d_model, max_len = 40, 32, 8
    item_embedding_table = nn.Embedding(n_items + 1, d_model, padding_idx=0)
    masking = CausalLanguageModeling(hidden_size=d_model, padding_idx=0, eval_on_last_item_seq_only=True)
    config = GPT2Config(n_embd=d_model, n_layer=2, n_head=2, n_positions=max_len, vocab_size=n_items + 1,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    gpt2 = GPT2Model(config)
    gpt2.eval()
    body = TransformerBlock(gpt2, masking=masking)
    head = NextItemPredictionTask(masking, item_embedding_table)

    # evaluation batch of sessions, right-padded with 0 (the last real item is the target)
    sessions = [[5, 12, 7, 33, 21, 9], [14, 3, 28], [2, 19, 19, 6, 31, 11, 25, 8], [36, 17, 4, 22]]
    item_ids = torch.zeros((len(sessions), max_len), dtype=torch.long)
    for i, s in enumerate(sessions):
        item_ids[i, : len(s)] = torch.tensor(s)

    with torch.no_grad():
        inputs = item_embedding_table(item_ids)
        masked_inputs = masking(inputs, item_ids, training=False, testing=True)
        hidden = body(masked_inputs)
        out = head(hidden, training=False, testing=True)

    print("fixed" if FIXED else "buggy")
    print("schema:", masking.mask_schema.int().tolist())
    print("labels:", out["labels"].tolist())
    print("target logits:", [round(v, 4) for v in out["predictions"][torch.arange(4), out["labels"]].tolist()])
    print("top-1:", out["predictions"].argmax(-1).tolist())
    print("eval loss: %.6f" % out["loss"].item())


if __name__ == "__main__":
    main()
