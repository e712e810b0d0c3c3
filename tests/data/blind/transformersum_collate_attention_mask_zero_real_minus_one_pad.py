# Citation: HHousen/TransformerSum commit 5e5a7f3cc2c52a3d980ac64c6b80a4ee6e241bce
#   ("Fix serious bug in the pad_batch_collate function that was left over from testing").
# Upstream: data.py pad_batch_collate (the "input_ids" branch builds attention_mask),
#   consumed by model.py ExtractiveSummarizer.forward -> word_embedding_model
#   (a transformers 2.x BertModel: extended mask = (1.0 - mask) * -10000.0),
#   pooling.py Pooling (sent_rep_tokens), classifier.py LinearClassifier,
#   ExtractiveSummarizer.compute_loss.
# Bug: the collate built attention_mask = [[0] * len(ids)] and padded it with -1, so
#   every real token carries 0 and every pad carries -1 (the comment above it says
#   1 = real, 0 = padding). BERT's additive mask then puts -10000 on all real keys
#   and -20000 on pads instead of 0 / -10000.
# Fix: attention_mask = [[1] * len(ids)] padded with 0.
# With BERT's additive mask in float32 the common -10000 on the real keys mostly
# cancels in the softmax (pads stay 10000 below), so the two runs differ in the
# low digits: the real-key scores are rounded at the 2**-10 spacing of 10000.
#
# Ported at tiny sizes: the BERT encoder is written out as transformers 2.8's
# BertModel computes it (embeddings, get_extended_attention_mask, eager
# self-attention), random weights instead of 'bert-base-uncased'.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- data.py -----------------------------------------------------------------
def pad(data, pad_id, width=None, pad_on_left=False):
    """Pad `data` with `pad_id` to `width` on the right by default but if `pad_on_left` then left."""
    if not width:
        width = max(len(d) for d in data)
    if pad_on_left:
        rtn_data = [[pad_id] * (width - len(d)) + d for d in data]
    else:
        rtn_data = [d + [pad_id] * (width - len(d)) for d in data]
    return rtn_data


def pad_batch_collate(batch, modifier=None):
    elem = batch[0]
    final_dictionary = {}

    for key in elem:
        if key == "sent_lengths":
            continue

        feature_list = [d[key] for d in batch]
        if key == "sent_rep_token_ids":
            feature_list = pad(feature_list, -1)
            sent_rep_token_ids = torch.tensor(feature_list)

            sent_rep_mask = ~(sent_rep_token_ids == -1)
            sent_rep_token_ids[sent_rep_token_ids == -1] = 0

            final_dictionary["sent_rep_token_ids"] = sent_rep_token_ids
            final_dictionary["sent_rep_mask"] = sent_rep_mask
            continue  # go to next key
        elif key == "input_ids":
            input_ids = feature_list

            # Attention
            # The mask has 1 for real tokens and 0 for padding tokens. Only real
            # tokens are attended to.
            if FIXED:
                attention_mask = [[1] * len(ids) for ids in input_ids]
            else:
                attention_mask = [[0] * len(ids) for ids in input_ids]

            input_ids_width = max(len(ids) for ids in input_ids)
            input_ids = pad(input_ids, 0, width=input_ids_width)
            input_ids = torch.tensor(input_ids)
            if FIXED:
                attention_mask = pad(attention_mask, 0)
            else:
                attention_mask = pad(attention_mask, -1)
            attention_mask = torch.tensor(attention_mask)

            final_dictionary["input_ids"] = input_ids
            final_dictionary["attention_mask"] = attention_mask
            continue

        elif key == "source" or key == "target":
            final_dictionary[key] = feature_list
            continue

        elif key == "labels" or key == "token_type_ids":
            feature_list = pad(feature_list, 0)

        feature_list = torch.tensor(feature_list)
        final_dictionary[key] = feature_list

    if modifier:
        final_dictionary = modifier(final_dictionary)

    return final_dictionary


# ---- transformers 2.8 modeling_bert.py (BertModel), shrunk ------------------------
class BertConfig:
    vocab_size = 120
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 64
    max_position_embeddings = 64
    type_vocab_size = 2
    layer_norm_eps = 1e-12
    initializer_range = 0.02


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, token_type_ids=None):
        seq_length = input_ids.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
                      + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.attn_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.out_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask):
        attention_output = self.attn_norm(self.attn_out(self.self(hidden_states, attention_mask)) + hidden_states)
        intermediate = nn.functional.gelu(self.intermediate(attention_output))
        return self.out_norm(self.output(intermediate) + attention_output)


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # We create a 3D attention mask from a 2D tensor mask.
        extended_attention_mask = attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=torch.float32)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        hidden_states = self.embeddings(input_ids, token_type_ids=token_type_ids)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, extended_attention_mask)
        return (hidden_states,)


# ---- pooling.py / classifier.py / model.py ---------------------------------------
class Pooling(nn.Module):
    def __init__(self, sent_rep_tokens=True, mean_tokens=False):
        super(Pooling, self).__init__()
        self.sent_rep_tokens = sent_rep_tokens
        self.mean_tokens = mean_tokens

    def forward(self, word_vectors=None, sent_rep_token_ids=None, sent_rep_mask=None,
                sent_lengths=None, sent_lengths_mask=None):
        output_vectors = []
        output_masks = []
        if self.sent_rep_tokens:
            sents_vec = word_vectors[
                torch.arange(word_vectors.size(0)).unsqueeze(1), sent_rep_token_ids
            ].squeeze()
            sents_vec = sents_vec * sent_rep_mask[:, :, None].float()
            output_vectors.append(sents_vec)
            output_masks.append(sent_rep_mask)
        output_vector = torch.cat(output_vectors, 1)
        output_mask = torch.cat(output_masks, 1)
        return output_vector, output_mask


class LinearClassifier(nn.Module):
    def __init__(self, web_hidden_size, linear_hidden=64, first_dropout=0.0, last_dropout=0.0):
        super(LinearClassifier, self).__init__()
        self.dropout1 = nn.Dropout(first_dropout) if first_dropout else nn.Identity()
        self.dropout2 = nn.Dropout(last_dropout) if last_dropout else nn.Identity()
        self.linear1 = nn.Linear(web_hidden_size, linear_hidden)
        self.linear2 = nn.Linear(linear_hidden, 1)
        self.sigmoid = nn.Sigmoid()
        self.activation = nn.GELU()

    def forward(self, x):
        x = self.dropout1(x)
        x = self.linear1(x)
        x = self.activation(x)
        x = self.linear2(x)
        x = self.dropout2(x)
        x = self.sigmoid(x)
        sent_scores = x.squeeze(-1)
        return sent_scores


class ExtractiveSummarizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embedding_model = BertModel(BertConfig())
        self.pooling_model = Pooling(sent_rep_tokens=True, mean_tokens=False)
        self.encoder = LinearClassifier(BertConfig.hidden_size)
        self.loss_func = nn.BCELoss(reduction="none")
        self.no_use_token_type_ids = False

    def forward(self, input_ids, attention_mask, sent_rep_mask=None, token_type_ids=None,
                sent_rep_token_ids=None, sent_lengths=None, sent_lengths_mask=None, labels=None):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if not self.no_use_token_type_ids:
            inputs["token_type_ids"] = token_type_ids
        outputs = self.word_embedding_model(**inputs)
        word_vectors = outputs[0]
        sents_vec, mask = self.pooling_model(
            word_vectors=word_vectors, sent_rep_token_ids=sent_rep_token_ids,
            sent_rep_mask=sent_rep_mask, sent_lengths=sent_lengths,
            sent_lengths_mask=sent_lengths_mask)
        sent_scores = self.encoder(sents_vec)
        sent_scores = sent_scores * mask.float()
        return sent_scores, mask

    def compute_loss(self, outputs, labels, mask):
        loss = self.loss_func(outputs, labels.float())
        loss = loss * mask.float()
        sum_loss_per_sequence = loss.sum(dim=1)
        num_not_padded_per_sequence = mask.sum(dim=1).float()
        total_loss = sum_loss_per_sequence.sum()
        total_num_not_padded = num_not_padded_per_sequence.sum().float()
        average_loss = total_loss / total_num_not_padded
        return total_loss, average_loss


def make_document(sent_lens, labels, g, cls_id=101, sep_id=102):
    # BertSum-style input: [CLS] sent [SEP] [CLS] sent [SEP] ..., alternating segment ids
    input_ids, token_type_ids, sent_rep_token_ids = [], [], []
    for i, n in enumerate(sent_lens):
        sent_rep_token_ids.append(len(input_ids))
        ids = [cls_id] + [int(t) for t in torch.randint(1, 100, (n,), generator=g)] + [sep_id]
        input_ids += ids
        token_type_ids += [i % 2] * len(ids)
    return {"input_ids": input_ids, "token_type_ids": token_type_ids,
            "sent_rep_token_ids": sent_rep_token_ids, "labels": labels}


def main():
    BertConfig.vocab_size = 110
    g = torch.Generator().manual_seed(1)
    batch = [
        make_document([6, 4, 7, 5], [1, 0, 1, 0], g),
        make_document([3, 5], [0, 1], g),
        make_document([4, 8, 3], [1, 0, 0], g),
    ]
    features = pad_batch_collate(batch)
    print("attention_mask[1]:", features["attention_mask"][1].tolist())

    model = ExtractiveSummarizer()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for step in range(6):
        outputs, mask = model(**features)
        total_loss, average_loss = model.compute_loss(outputs, features["labels"], mask)
        optimizer.zero_grad()
        total_loss.backward()
        optimizer.step()
        print(f"step {step} total_loss {total_loss.item():.8f} average_loss {average_loss.item():.8f}")
    model.eval()
    with torch.no_grad():
        sent_scores, mask = model(**features)
    print("sent_scores:", [[round(v, 8) for v in row] for row in sent_scores.tolist()])


if __name__ == "__main__":
    main()
