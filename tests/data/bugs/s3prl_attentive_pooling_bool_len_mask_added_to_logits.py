# s3prl/s3prl#579 (open issue, against ec8064b5; `--fixed` applies the fix the issue gives).
# s3prl's utterance-level downstream (s3prl/downstream/model.py: UtteranceLevel -> AttentivePooling ->
# AttentivePoolingModule), used by experts such as speech_commands with `pooling: AttentivePooling`.
# AttentivePooling builds `len_masks` as a boolean (True on real frames) and AttentivePoolingModule adds it to
# the attention logits as they are (`att_logits = att_mask + att_logits`), so real frames get +1 and padded
# frames +0: the softmax over frames still gives the padded frames of the shorter utterances weight.
# (Other s3prl downstreams, e.g. emotion/model.py, hand this module an additive `(1 - mask) * -100000` mask.)
# Fix from the issue: `att_logits = att_logits + (~att_mask) * (-1e9)`.
# The upstream is a tiny HuBERT built from its config class; features are per-utterance, as s3prl's featurizer
# hands them to an expert.
import sys

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence
from transformers import HubertConfig, HubertModel

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def get_downstream_model(input_dim, output_dim, config):
    model_cls = eval(config['select'])
    model_conf = config.get(config['select'], {})
    model = model_cls(input_dim, output_dim, **model_conf)
    return model


class FrameLevel(nn.Module):
    def __init__(self, input_dim, output_dim, hiddens=None, activation='ReLU', **kwargs):
        super().__init__()
        latest_dim = input_dim
        self.hiddens = []
        if hiddens is not None:
            for dim in hiddens:
                self.hiddens += [
                    nn.Linear(latest_dim, dim),
                    getattr(nn, activation)(),
                ]
                latest_dim = dim
        self.hiddens = nn.Sequential(*self.hiddens)
        self.linear = nn.Linear(latest_dim, output_dim)

    def forward(self, hidden_state, features_len=None):
        hidden_state = self.hiddens(hidden_state)
        logit = self.linear(hidden_state)
        return logit, features_len


class UtteranceLevel(nn.Module):
    def __init__(self, input_dim, output_dim, pooling='MeanPooling', activation='ReLU', pre_net=None,
                 post_net={'select': 'FrameLevel'}, **kwargs):
        super().__init__()
        latest_dim = input_dim
        self.pre_net = get_downstream_model(latest_dim, latest_dim, pre_net) if isinstance(pre_net, dict) else None
        self.pooling = eval(pooling)(input_dim=latest_dim, activation=activation)
        self.post_net = get_downstream_model(latest_dim, output_dim, post_net)

    def forward(self, hidden_state, features_len=None):
        if self.pre_net is not None:
            hidden_state, features_len = self.pre_net(hidden_state, features_len)
        pooled, features_len = self.pooling(hidden_state, features_len)
        logit, features_len = self.post_net(pooled, features_len)
        return logit, features_len


class AttentivePooling(nn.Module):
    ''' Attentive Pooling module incoporate attention mask'''

    def __init__(self, input_dim, activation, **kwargs):
        super(AttentivePooling, self).__init__()
        self.sap_layer = AttentivePoolingModule(input_dim, activation)

    def forward(self, feature_BxTxH, features_len):
        device = feature_BxTxH.device
        len_masks = torch.lt(torch.arange(features_len.max()).unsqueeze(0).to(device), features_len.unsqueeze(1))
        sap_vec, _ = self.sap_layer(feature_BxTxH, len_masks)
        return sap_vec, torch.ones(len(feature_BxTxH)).long()


class AttentivePoolingModule(nn.Module):
    def __init__(self, input_dim, activation='ReLU', **kwargs):
        super(AttentivePoolingModule, self).__init__()
        self.W_a = nn.Linear(input_dim, input_dim)
        self.W = nn.Linear(input_dim, 1)
        self.act_fn = getattr(nn, activation)()
        self.softmax = nn.functional.softmax

    def forward(self, batch_rep, att_mask):
        att_logits = self.W(self.act_fn(self.W_a(batch_rep))).squeeze(-1)
        if FIXED:
            att_logits = att_logits + (~att_mask) * (-1e9)
        else:
            att_logits = att_mask + att_logits
        att_w = self.softmax(att_logits, dim=-1).unsqueeze(-1)
        utter_rep = torch.sum(batch_rep * att_w, dim=1)
        return utter_rep, att_w


class DownstreamExpert(nn.Module):
    """speech_commands-style expert: projector + UtteranceLevel, as its config selects it."""

    def __init__(self, upstream_dim, class_num, modelrc):
        super().__init__()
        self.modelrc = modelrc
        model_cls = eval(self.modelrc['select'])
        model_conf = self.modelrc.get(self.modelrc['select'], {})
        self.projector = nn.Linear(upstream_dim, self.modelrc['projector_dim'])
        self.model = model_cls(input_dim=self.modelrc['projector_dim'], output_dim=class_num, **model_conf)
        self.objective = nn.CrossEntropyLoss()

    def forward(self, mode, features, labels, records):
        device = features[0].device
        features_len = torch.IntTensor([len(feat) for feat in features]).to(device=device)
        features = pad_sequence(features, batch_first=True)
        features = self.projector(features)
        predicted, _ = self.model(features, features_len)

        labels = torch.LongTensor(labels).to(features.device)
        loss = self.objective(predicted, labels)
        predicted_classid = predicted.max(dim=-1).indices
        records['acc'] += (predicted_classid == labels).view(-1).cpu().float().tolist()
        records['loss'].append(loss.item())
        records['logits'] = predicted
        return loss


def main():
    config = HubertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer", do_stable_layer_norm=True,
    )
    upstream = HubertModel(config).eval()

    modelrc = {
        'projector_dim': 24,
        'select': 'UtteranceLevel',
        'UtteranceLevel': {'pooling': 'AttentivePooling'},
    }
    expert = DownstreamExpert(config.hidden_size, class_num=5, modelrc=modelrc).eval()

    wavs = [torch.randn(1600), torch.randn(700), torch.randn(1100)]
    labels = [3, 1, 4]
    with torch.no_grad():
        # the upstream returns one (T_i, H) feature sequence per utterance
        features = [upstream(w.unsqueeze(0)).last_hidden_state[0] for w in wavs]
        records = {'acc': [], 'loss': []}
        loss = expert('test', features, labels, records)
    print("frames per utterance:", [len(f) for f in features])
    print("loss:", round(loss.item(), 6))
    print("logits:", [[round(v, 5) for v in row] for row in records['logits'].tolist()])


if __name__ == "__main__":
    main()
