# THUwangcy/ReChorus commit e743897 ("Update dataset generation; Change default seed to 0;
# fix a bug in NARM"), src/models/sequential/NARM.py.
#
# NARM (session-based recommendation): a global GRU and a local GRU run over each user's
# history (0 = padding item, histories padded on the right to the batch's longest one).
# The local encoder's attention scores every history step against the last global hidden
# state.  Before the fix the scores were filled with -inf at padded steps and normalised
# with a softmax over the history axis; NARM's item-level attention weights are not
# normalised, and the fix keeps the raw (sigmoid-projected) scores and fills the padded
# steps with 0 instead.
import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Args:
    emb_size = 16
    hidden_size = 20
    attention_size = 12


class NARM(nn.Module):
    def __init__(self, args, item_num):
        super().__init__()
        self.emb_size = args.emb_size
        self.hidden_size = args.hidden_size
        self.attention_size = args.attention_size
        self.item_num = item_num
        self._define_params()

    def _define_params(self):
        self.i_embeddings = nn.Embedding(self.item_num, self.emb_size)
        self.encoder_g = nn.GRU(input_size=self.emb_size, hidden_size=self.hidden_size, batch_first=True)
        self.encoder_l = nn.GRU(input_size=self.emb_size, hidden_size=self.hidden_size, batch_first=True)
        self.A1 = nn.Linear(self.hidden_size, self.attention_size, bias=False)
        self.A2 = nn.Linear(self.hidden_size, self.attention_size, bias=False)
        self.attention_out = nn.Linear(self.attention_size, 1, bias=False)
        self.out = nn.Linear(2 * self.hidden_size, self.emb_size, bias=False)

    def forward(self, feed_dict):
        self.check_list = []
        i_ids = feed_dict['item_id']  # [batch_size, -1]
        history = feed_dict['history_items']  # [batch_size, history_max]
        lengths = feed_dict['lengths']  # [batch_size]

        # Embedding Layer
        i_vectors = self.i_embeddings(i_ids)
        his_vectors = self.i_embeddings(history)

        # Encoding Layer
        sort_his_lengths, sort_idx = torch.topk(lengths, k=len(lengths))
        sort_his_vectors = his_vectors.index_select(dim=0, index=sort_idx)
        history_packed = torch.nn.utils.rnn.pack_padded_sequence(sort_his_vectors, sort_his_lengths, batch_first=True)
        _, hidden_g = self.encoder_g(history_packed, None)
        output_l, hidden_l = self.encoder_l(history_packed, None)
        output_l, _ = torch.nn.utils.rnn.pad_packed_sequence(output_l, batch_first=True)
        unsort_idx = torch.topk(sort_idx, k=len(lengths), largest=False)[1]
        output_l = output_l.index_select(dim=0, index=unsort_idx)  # [batch_size, history_max, emb_size]
        hidden_g = hidden_g[-1].index_select(dim=0, index=unsort_idx)  # [batch_size, emb_size]

        # Attention Layer
        attention_g = self.A1(hidden_g)
        attention_l = self.A2(output_l)
        attention_value = self.attention_out((attention_g[:, None, :] + attention_l).sigmoid())
        mask = (history > 0).unsqueeze(-1)
        if FIXED:
            attention_value = attention_value.masked_fill(mask == 0, 0)
        else:
            attention_value = attention_value - attention_value.max()
            attention_value = attention_value.masked_fill(mask == 0, -np.inf).softmax(dim=1)
        c_l = (attention_value * output_l).sum(1)

        # Prediction Layer
        pred_vector = self.out(torch.cat((hidden_g, c_l), dim=1))
        prediction = (pred_vector[:, None, :] * i_vectors).sum(dim=-1)
        return {'prediction': prediction.view(feed_dict['batch_size'], -1)}


def collate(histories, candidates):
    # SequentialModel.Dataset: history_items padded with 0 on the right to the batch max
    lengths = torch.tensor([len(h) for h in histories])
    his = torch.nn.utils.rnn.pad_sequence([torch.tensor(h) for h in histories], batch_first=True, padding_value=0)
    return {
        'item_id': torch.tensor(candidates),
        'history_items': his,
        'lengths': lengths,
        'batch_size': len(histories),
    }


def main():
    torch.manual_seed(0)
    item_num = 30
    model = NARM(Args(), item_num).eval()
    histories = [[3, 7, 12, 5, 9], [4, 18], [21, 2, 11]]
    candidates = [[9, 1, 2, 3], [6, 7, 8, 10], [13, 14, 15, 16]]  # target first, then negatives
    feed = collate(histories, candidates)
    with torch.no_grad():
        out = model(feed)['prediction']
    print("prediction:")
    print(out)
    print("top-1 per user:", out.argmax(-1).tolist())


if __name__ == "__main__":
    main()
