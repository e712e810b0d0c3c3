"""TinyLLaVA Factory SFT step on a Phi backbone (pad = eos): collator mask, image features spliced in, re-padded batch.

Correct program. Port (tokenizer, template and image loading left out: token ids, labels and pixel tensors are given
directly; the CLIP tower built from a tiny CLIPVisionConfig instead of from_pretrained) of TinyLLaVA/TinyLLaVA_Factory:
* tinyllava/data/dataset.py @0fd715495c925ea97986d2b4c04790408644d031: DataCollatorForSupervisedDataset.__call__
  (pad = eos hack: eos ids set to -300 before `pad_sequence`, `attention_mask = input_ids.ne(pad_token_id)`, then
  -300 turned back into eos; labels padded with IGNORE_INDEX; images stacked);
* tinyllava/model/modeling_tinyllava.py @269acebb20db22ccdec5aa714469c8f4e937a4b2:
  TinyLlavaForConditionalGeneration.forward and prepare_inputs_labels_for_multimodal (padding stripped with the
  attention mask, each IMAGE_TOKEN_INDEX replaced by the connector's image features with IGNORE_INDEX labels,
  truncation to tokenizer_model_max_length, re-padding on `tokenizer_padding_side` with a new attention mask,
  position_ids handed back as None when none came in);
* tinyllava/model/vision_tower/clip.py and connector/mlp.py (recalled): `hidden_states[vision_feature_layer]`,
  strategy "patch" drops CLS; mlp2x_gelu connector.
The language model is transformers' PhiForCausalLM built from a tiny PhiConfig whose pad id is its eos id.

Check: three samples of different lengths (each with one image, the answer ending in eos) are collated (right padded,
as the collator does) and run through one training forward, the spliced batch re-padded on the right (training's
`tokenizer_padding_side`) and then on the left; the batch loss must equal the token-weighted mean of each sample's
loss run alone (batch of one, no padding), and every real position's logits must equal that lone run's.
"""
from typing import Dict, Sequence

import torch
import torch.nn as nn
from transformers import CLIPVisionConfig, CLIPVisionModel, PhiConfig, PhiForCausalLM, PretrainedConfig

torch.manual_seed(0)

IGNORE_INDEX = -100
IMAGE_TOKEN_INDEX = -200

VOCAB = 80
EOS = 50  # phi: eos = pad = unk
IMAGE_SIZE, PATCH = 8, 4


# ---------------------------------------------------------------- tinyllava/data/dataset.py


class Tokenizer:
    pad_token_id = EOS
    eos_token_id = EOS
    model_max_length = 64


class DataCollatorForSupervisedDataset(object):
    """Collate examples for supervised fine-tuning."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, instances: Sequence[Dict]) -> Dict[str, torch.Tensor]:
        input_ids, labels = tuple(
            [instance[key] for instance in instances] for key in ("input_ids", "labels")
        )
        if self.tokenizer.pad_token_id == self.tokenizer.eos_token_id:
            for input_id in input_ids:
                input_id[input_id == self.tokenizer.eos_token_id] = -300
        input_ids = torch.nn.utils.rnn.pad_sequence(
            input_ids, batch_first=True, padding_value=self.tokenizer.pad_token_id
        )
        labels = torch.nn.utils.rnn.pad_sequence(
            labels, batch_first=True, padding_value=IGNORE_INDEX
        )
        input_ids = input_ids[:, : self.tokenizer.model_max_length]
        attention_mask = input_ids.ne(self.tokenizer.pad_token_id)
        labels = labels[:, : self.tokenizer.model_max_length]
        # FIXME: This is a hack for handling phi and stablelm, as they have the same eos, pad and unk. We want the model
        # FIXME: to predict the eos in the input ids, but we also use the id of eos to pad sequence, so we use a temp
        # FIXME: eos id first, and convert them back.
        if self.tokenizer.pad_token_id == self.tokenizer.eos_token_id:
            for input_id in input_ids:
                input_id[input_id == -300] = self.tokenizer.eos_token_id

        batch = dict(
            input_ids=input_ids,
            labels=labels,
            attention_mask=attention_mask,
        )

        if "image" in instances[0]:
            images = [instance["image"] for instance in instances]
            if all(x is not None and x.shape == images[0].shape for x in images):
                batch["images"] = torch.stack(images)
            else:
                batch["images"] = images

        return batch


# ---------------------------------------------------------------- vision tower / connector


class CLIPVisionTower(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self._vision_tower = CLIPVisionModel(cfg)

    def forward(self, x, **kwargs):
        image_features = self._vision_tower(x, output_hidden_states=True)
        image_features = image_features.hidden_states[kwargs.get("vision_feature_layer", -2)]

        if kwargs.get("vision_feature_select_strategy", "patch") == "patch":
            image_features = image_features[:, 1:]
        elif kwargs.get("vision_feature_select_strategy", "patch") == "cls_patch":
            image_features = image_features
        else:
            raise ValueError(f"Unexpected select feature: {kwargs.get('vision_feature_select_strategy')}")
        return image_features


class MLPConnector(nn.Module):

    def __init__(self, config):
        super().__init__()
        modules = [nn.Linear(config.vision_hidden_size, config.hidden_size)]
        for _ in range(1, 2):  # mlp2x_gelu
            modules.append(nn.GELU())
            modules.append(nn.Linear(config.hidden_size, config.hidden_size))
        self._connector = nn.Sequential(*modules)

    def forward(self, x):
        return self._connector(x)


# ---------------------------------------------------------------- tinyllava/model/modeling_tinyllava.py


class TinyLlavaConfig(PretrainedConfig):
    model_type = "tinyllava"

    def __init__(self, text_config=None, vision_config=None, connector_type="mlp2x_gelu",
                 vision_feature_layer=-2, vision_feature_select_strategy="patch",
                 tokenizer_padding_side="right", tokenizer_model_max_length=64, **kwargs):
        super().__init__(**kwargs)
        self.text_config = text_config
        self.vision_config = vision_config
        self.connector_type = connector_type
        self.vision_feature_layer = vision_feature_layer
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self.tokenizer_padding_side = tokenizer_padding_side
        self.tokenizer_model_max_length = tokenizer_model_max_length
        self.hidden_size = text_config.hidden_size
        self.vision_hidden_size = vision_config.hidden_size
        self.use_cache = False


class TinyLlavaForConditionalGeneration(nn.Module):

    def __init__(self, config: TinyLlavaConfig):
        super().__init__()
        self.config = config
        self.language_model = PhiForCausalLM(config.text_config)
        self.vision_tower = CLIPVisionTower(config.vision_config)
        self.connector = MLPConnector(config)

    @property
    def device(self):
        return next(self.parameters()).device

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, images=None, image_sizes=None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if inputs_embeds is None:
            (
                input_ids,
                position_ids,
                attention_mask,
                past_key_values,
                inputs_embeds,
                labels
            ) = self.prepare_inputs_labels_for_multimodal(
                input_ids,
                position_ids,
                attention_mask,
                past_key_values,
                labels,
                images,
                image_sizes
            )
        return self.language_model.forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
        ), labels, attention_mask

    def encode_images(self, images):
        kwargs = {}
        kwargs['vision_feature_layer'] = self.config.vision_feature_layer
        kwargs['vision_feature_select_strategy'] = self.config.vision_feature_select_strategy
        images = images.to(device=self.device, dtype=self.dtype)
        image_features = self.vision_tower(images, **kwargs)
        return image_features

    def prepare_inputs_labels_for_multimodal(
        self, input_ids, position_ids, attention_mask, past_key_values, labels,
        images, image_sizes=None
    ):
        vision_tower = self.vision_tower
        if vision_tower is None or images is None or input_ids.shape[1] == 1:
            return input_ids, position_ids, attention_mask, past_key_values, None, labels

        raw_image_features = self.encode_images(images)

        _labels = labels
        _position_ids = position_ids
        _attention_mask = attention_mask
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            attention_mask = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(0, input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        if labels is None:
            labels = torch.full_like(input_ids, IGNORE_INDEX)

        # remove the padding using attention_mask -- FIXME
        _input_ids = input_ids
        input_ids = [cur_input_ids[cur_attention_mask] for cur_input_ids, cur_attention_mask in zip(input_ids, attention_mask)]
        labels = [cur_labels[cur_attention_mask] for cur_labels, cur_attention_mask in zip(labels, attention_mask)]

        new_input_embeds = []
        new_labels = []
        cur_image_idx = 0
        for batch_idx, cur_input_ids in enumerate(input_ids):
            num_images = (cur_input_ids == IMAGE_TOKEN_INDEX).sum()

            image_token_indices = [-1] + torch.where(cur_input_ids == IMAGE_TOKEN_INDEX)[0].tolist() + [cur_input_ids.shape[0]]
            cur_input_ids_noim = []
            cur_labels = labels[batch_idx]
            cur_labels_noim = []
            for i in range(len(image_token_indices) - 1):
                cur_input_ids_noim.append(cur_input_ids[image_token_indices[i]+1:image_token_indices[i+1]])
                cur_labels_noim.append(cur_labels[image_token_indices[i]+1:image_token_indices[i+1]])
            split_sizes = [x.shape[0] for x in cur_labels_noim]
            cur_input_embeds = self.language_model.get_input_embeddings()(torch.cat(cur_input_ids_noim))
            cur_input_embeds_no_im = torch.split(cur_input_embeds, split_sizes, dim=0)
            cur_new_input_embeds = []
            cur_new_labels = []

            if 'text_aware' in self.config.connector_type:
                raise NotImplementedError
            else:
                image_features = self.connector(raw_image_features)

            for i in range(num_images + 1):
                cur_new_input_embeds.append(cur_input_embeds_no_im[i])
                cur_new_labels.append(cur_labels_noim[i])
                if i < num_images:
                    cur_image_features = image_features[cur_image_idx]
                    cur_image_idx += 1
                    cur_new_input_embeds.append(cur_image_features)
                    cur_new_labels.append(torch.full((cur_image_features.shape[0],), IGNORE_INDEX, device=cur_labels.device, dtype=cur_labels.dtype))

            cur_new_input_embeds = [x.to(self.device) for x in cur_new_input_embeds]

            cur_new_input_embeds = torch.cat(cur_new_input_embeds)
            cur_new_labels = torch.cat(cur_new_labels)

            new_input_embeds.append(cur_new_input_embeds)
            new_labels.append(cur_new_labels)

        # Truncate sequences to max length as image embeddings can make the sequence longer
        tokenizer_model_max_length = getattr(self.config, 'tokenizer_model_max_length', None)
        if tokenizer_model_max_length is not None:
            new_input_embeds = [x[:tokenizer_model_max_length] for x in new_input_embeds]
            new_labels = [x[:tokenizer_model_max_length] for x in new_labels]

        # Combine them
        max_len = max(x.shape[0] for x in new_input_embeds)
        batch_size = len(new_input_embeds)

        new_input_embeds_padded = []
        new_labels_padded = torch.full((batch_size, max_len), IGNORE_INDEX, dtype=new_labels[0].dtype, device=new_labels[0].device)
        attention_mask = torch.zeros((batch_size, max_len), dtype=attention_mask.dtype, device=attention_mask.device)
        position_ids = torch.zeros((batch_size, max_len), dtype=position_ids.dtype, device=position_ids.device)

        for i, (cur_new_embed, cur_new_labels) in enumerate(zip(new_input_embeds, new_labels)):
            cur_len = cur_new_embed.shape[0]
            if getattr(self.config, 'tokenizer_padding_side', 'right') == "left":
                new_input_embeds_padded.append(torch.cat((
                    torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype, device=cur_new_embed.device),
                    cur_new_embed
                ), dim=0))
                if cur_len > 0:
                    new_labels_padded[i, -cur_len:] = cur_new_labels
                    attention_mask[i, -cur_len:] = True
                    position_ids[i, -cur_len:] = torch.arange(0, cur_len, dtype=position_ids.dtype, device=position_ids.device)
            else:
                new_input_embeds_padded.append(torch.cat((
                    cur_new_embed,
                    torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype, device=cur_new_embed.device)
                ), dim=0))
                if cur_len > 0:
                    new_labels_padded[i, :cur_len] = cur_new_labels
                    attention_mask[i, :cur_len] = True
                    position_ids[i, :cur_len] = torch.arange(0, cur_len, dtype=position_ids.dtype, device=position_ids.device)

        new_input_embeds = torch.stack(new_input_embeds_padded, dim=0)

        if _labels is None:
            new_labels = None
        else:
            new_labels = new_labels_padded

        if _attention_mask is None:
            attention_mask = None
        else:
            attention_mask = attention_mask.to(dtype=_attention_mask.dtype)

        if _position_ids is None:
            position_ids = None

        return None, position_ids, attention_mask, past_key_values, new_input_embeds, new_labels


def make_instance(prompt, answer):
    # prompt holds the IMAGE_TOKEN_INDEX placeholder; the answer ends with eos; prompt labels masked (IGNORE_INDEX)
    input_ids = torch.tensor(prompt + answer + [EOS], dtype=torch.long)
    labels = torch.tensor([IGNORE_INDEX] * len(prompt) + answer + [EOS], dtype=torch.long)
    return dict(input_ids=input_ids, labels=labels, image=torch.randn(3, IMAGE_SIZE, IMAGE_SIZE))


def main():
    text_config = PhiConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, partial_rotary_factor=0.5, bos_token_id=EOS, eos_token_id=EOS,
        pad_token_id=EOS, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
    )
    vision_config = CLIPVisionConfig(
        hidden_size=24, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, num_channels=3,
    )
    config = TinyLlavaConfig(text_config=text_config, vision_config=vision_config,
                             tokenizer_padding_side="right", tokenizer_model_max_length=64)
    model = TinyLlavaForConditionalGeneration(config).eval()
    collator = DataCollatorForSupervisedDataset(Tokenizer())
    for padding_side in ("right", "left"):
        config.tokenizer_padding_side = padding_side
        check(model, collator)
    print("ok: padded multimodal SFT batch (re-padded right and left) matches each sample alone")


def check(model, collator):
    instances = [
        make_instance([3, IMAGE_TOKEN_INDEX, 4, 5], [6, 7]),
        make_instance([3, IMAGE_TOKEN_INDEX, 4, 8, 9, 10, 11, 5], [12, 13, 14, 15, 16]),
        make_instance([3, 17, IMAGE_TOKEN_INDEX, 4, 5], [18, 19, 20]),
    ]

    def clone(inst):
        return {k: v.clone() for k, v in inst.items()}

    batch = collator([clone(x) for x in instances])
    assert batch["attention_mask"].sum(1).tolist() == [len(x["input_ids"]) for x in instances]
    with torch.no_grad():
        out, new_labels, new_mask = model(**batch)

    total_loss, total_count = 0.0, 0
    for i, inst in enumerate(instances):
        alone = collator([clone(inst)])
        assert alone["attention_mask"].all()
        with torch.no_grad():
            ref, ref_labels, _ = model(**alone)
        n = int((ref_labels[0, 1:] != IGNORE_INDEX).sum())
        total_loss += ref.loss.item() * n
        total_count += n
        real = new_mask[i].bool()
        assert int(real.sum()) == ref.logits.shape[1]
        torch.testing.assert_close(out.logits[i][real], ref.logits[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(new_labels[i][real], ref_labels[0])

    expected = total_loss / total_count
    torch.testing.assert_close(out.loss.item(), expected, atol=1e-5, rtol=1e-5)
    print(model.config.tokenizer_padding_side, "batch loss", round(out.loss.item(), 6),
          "per-sample weighted", round(expected, 6), "lengths", new_mask.sum(1).tolist())


if __name__ == "__main__":
    main()
