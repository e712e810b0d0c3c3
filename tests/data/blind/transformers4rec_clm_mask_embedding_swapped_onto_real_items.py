# NVIDIA-Merlin/Transformers4Rec commit 10f50549 ("Fixed bug with Causal LM and GRU (were masking the wrong
# positions"), codes/recsys_meta_model.py, RecSysMetaModel.forward, read at 10f50549^.
#
# Session-based next-item prediction with GPT-2 over item sessions right-padded with pad_token 0. The model is
# handed no attention_mask: a slot whose next-item target is padding is represented by the trainable
# `masked_item_embedding` instead. Before the fix, the causal-LM branch called
# torch.where(mask_trg_pad, masked_item_embedding, pos_emb_inp): every slot with a real target (the real items)
# was overwritten by the [MASK] embedding and the padded tail kept its embedding, so GPT-2 attended to [MASK]
# vectors where the session's items were. The fix swaps the two branches:
# torch.where(mask_trg_pad, pos_emb_inp, masked_item_embedding).
# (The original also passed a lower-triangular head_mask to GPT2Model; GPT-2 is causal on its own and the
# installed transformers no longer takes head_mask, so it is left out.)
import sys
from collections import OrderedDict

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

FIXED = "--fixed" in sys.argv


class Args:
    d_model = 16
    n_head = 2
    n_layer = 2
    max_seq_len = 6
    pad_token = 0
    num_items = 20
    eval_on_last_item_seq_only = False
    train_on_last_item_seq_only = False


class RecSysMetaModel(nn.Module):
    def __init__(self, model, args):
        super().__init__()
        self.model = model
        self.pad_token = args.pad_token
        self.max_seq_len = args.max_seq_len
        self.n_layer = args.n_layer
        self.eval_on_last_item_seq_only = args.eval_on_last_item_seq_only
        self.train_on_last_item_seq_only = args.train_on_last_item_seq_only
        self.embedding_tables = nn.ModuleDict(
            {"sess_pid_seq": nn.Embedding(args.num_items, args.d_model, padding_idx=self.pad_token)}
        )
        self.mlp_merge = nn.Linear(args.d_model, args.d_model)
        self.tf_out_act = torch.tanh
        self.masked_item_embedding = nn.Parameter(torch.Tensor(args.d_model))
        nn.init.normal_(self.masked_item_embedding, mean=0, std=0.4)
        self.transformer_output_project = nn.Linear(args.d_model, args.d_model)
        self.output_layer = nn.Linear(args.d_model, args.num_items)
        self.log_softmax = nn.LogSoftmax(dim=-1)
        self.loss_nll = nn.NLLLoss(ignore_index=self.pad_token)

    def feature_process(self, inputs):
        label_seq = inputs["sess_pid_seq"]
        pos_inp = self.embedding_tables["sess_pid_seq"](label_seq)
        return pos_inp, label_seq, label_seq.shape[1]

    def remove_pad_3d(self, inp_tensor, non_pad_mask):
        inp_tensor = inp_tensor.flatten(end_dim=1)
        inp_tensor_fl = torch.masked_select(inp_tensor, non_pad_mask.unsqueeze(1).expand_as(inp_tensor))
        return inp_tensor_fl.view(-1, inp_tensor.size(1))

    def forward(self, inputs):
        pos_inp, label_seq, max_seq_len = self.feature_process(inputs)

        # Predict Next token
        label_seq_inp = label_seq[:, :-1]
        label_seq_trg = label_seq[:, 1:]

        # apply mask on input where target is on padding token
        mask_trg_pad = label_seq_trg != self.pad_token
        label_seq_inp = label_seq_inp * mask_trg_pad

        if (self.eval_on_last_item_seq_only and not self.training) or (
            self.train_on_last_item_seq_only and self.training
        ):
            rows_ids = torch.arange(label_seq_inp.size(0), dtype=torch.long)
            last_item_sessions = mask_trg_pad.sum(axis=1) - 1
            label_seq_trg_eval = torch.zeros(label_seq_trg.shape, dtype=torch.long)
            label_seq_trg_eval[rows_ids, last_item_sessions] = label_seq_trg[rows_ids, last_item_sessions]
            label_seq_trg = label_seq_trg_eval
            mask_trg_pad = label_seq_trg != self.pad_token

        # Step 2. Merge features
        pos_emb = self.tf_out_act(self.mlp_merge(pos_inp))

        # Truncating the input sequences length to -1
        pos_emb_inp = pos_emb[:, :-1]
        # Replacing the inputs corresponding to masked label with a trainable embedding
        if FIXED:
            pos_emb_inp = torch.where(
                mask_trg_pad.unsqueeze(-1).bool(),
                pos_emb_inp,
                self.masked_item_embedding.to(pos_emb_inp.dtype),
            )
        else:
            pos_emb_inp = torch.where(
                mask_trg_pad.unsqueeze(-1).bool(),
                self.masked_item_embedding.to(pos_emb_inp.dtype),
                pos_emb_inp,
            )

        # Step3. Transformer model
        model_outputs = self.model(inputs_embeds=pos_emb_inp)
        pos_emb_pred = model_outputs[0]

        pos_emb_pred = self.tf_out_act(self.transformer_output_project(pos_emb_pred))

        trg_flat = label_seq_trg.flatten()
        non_pad_mask = trg_flat != self.pad_token
        labels_all = torch.masked_select(trg_flat, non_pad_mask)
        pos_emb_pred = self.remove_pad_3d(pos_emb_pred, non_pad_mask)

        logits_all = self.output_layer(pos_emb_pred)
        predictions_all = self.log_softmax(logits_all)
        loss = self.loss_nll(predictions_all, labels_all)
        _, max_idx = torch.max(logits_all, dim=1)
        train_acc = (max_idx == labels_all).mean(dtype=torch.float32)
        return OrderedDict(loss=loss, acc=train_acc, predictions=predictions_all, labels=labels_all)


def main():
    torch.manual_seed(0)
    args = Args()
    config = GPT2Config(
        n_embd=args.d_model,
        n_inner=args.d_model * 4,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_positions=args.max_seq_len - 1,
        vocab_size=1,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    model = RecSysMetaModel(GPT2Model(config), args)
    model.eval()

    # two sessions, right-padded with pad_token 0
    inputs = {"sess_pid_seq": torch.tensor([[3, 7, 11, 5, 0, 0], [9, 2, 14, 6, 8, 4]])}
    with torch.no_grad():
        out = model(inputs)
    print("loss", round(out["loss"].item(), 6), "acc", round(out["acc"].item(), 4))
    print("top item per target", out["predictions"].argmax(-1).tolist(), "labels", out["labels"].tolist())


if __name__ == "__main__":
    main()
