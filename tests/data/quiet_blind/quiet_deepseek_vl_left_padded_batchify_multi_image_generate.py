"""DeepSeek-VL batched multi-image chat: left-padded `batchify`, image embeddings spliced into the text, greedy generate.

Correct program. Port (tokenizer and PIL image processor left out: ids and pixel tensors are given directly; the
SigLIP / SAM towers replaced by the tower's huggingface branch, a CLIPVisionModel built from a tiny CLIPVisionConfig
instead of `from_pretrained`) of deepseek-ai/DeepSeek-VL @d04d289cb8ef9e1e02f7e4eae7e817d572dcb07f:
* deepseek_vl/models/processing_vlm.py: VLChatProcessor.add_image_token (each `<image_placeholder>` expanded to
  `num_image_tokens` image ids), process_one, batchify (left padding: `batched_attention_mask[i, -seq_len:] = 1`,
  `batched_images_seq_mask[i, -seq_len:] = input_ids == self.image_id`, `images_emb_mask[i, j, :n_image_tokens]`,
  pixel_values zero-padded to `max_n_images`, pad id = eos when the tokenizer has none);
* deepseek_vl/models/modeling_vlm.py: MultiModalityConfig (vision / aligner / LlamaConfig language_config),
  MultiModalityCausalLM.prepare_inputs_embeds (`inputs_embeds[images_seq_mask] = images_embeds[images_emb_mask]`);
* deepseek_vl/models/clip_encoder.py: CLIPVisionTower (huggingface branch, `output_hidden_states=True`,
  `hidden_states[select_layer]`, select_feature "patch" drops the CLS token);
* deepseek_vl/serve/inference.py @48cc0deea67786d3564d23c970b8539c045f98a3: generate (`language_model.generate(
  inputs_embeds=..., attention_mask=prepare_inputs.attention_mask, pad_token_id=eos, do_sample=False,
  use_cache=True)`);
* deepseek_vl/models/projector.py (not in the stored snapshot; recalled): MlpProjector "mlp_gelu", depth 2.

Check: two conversations (one image and a short prompt, two images and a longer prompt; a third with no image in a
second batch) are batchified together and generated greedily; each row's generated tokens and its first-step logits
must equal the same conversation batchified alone (no padding).
"""
from dataclasses import dataclass
from typing import List

import torch
import torch.nn as nn
from transformers import (
    CLIPVisionConfig,
    CLIPVisionModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

torch.manual_seed(0)

VOCAB = 64
BOS, EOS = 1, 2
IMAGE_ID = 63  # "<image_placeholder>" added to the tokenizer
IMAGE_SIZE, PATCH = 8, 4
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


# ---------------------------------------------------------------- processing_vlm.py


class DictOutput(object):

    def keys(self):
        return self.__dict__.keys()

    def __getitem__(self, item):
        return self.__dict__[item]

    def __setitem__(self, key, value):
        self.__dict__[key] = value


@dataclass
class VLChatProcessorOutput(DictOutput):
    sft_format: str
    input_ids: torch.Tensor
    pixel_values: torch.Tensor
    num_image_tokens: torch.IntTensor

    def __len__(self):
        return len(self.input_ids)


@dataclass
class BatchedVLChatProcessorOutput(DictOutput):
    sft_format: List[str]
    input_ids: torch.Tensor
    pixel_values: torch.Tensor
    attention_mask: torch.Tensor
    images_seq_mask: torch.BoolTensor
    images_emb_mask: torch.BoolTensor


class VLChatProcessor:
    """The processor without its tokenizer / image processor: ids and pixels come in ready."""

    default_shape = (3, IMAGE_SIZE, IMAGE_SIZE)

    def __init__(self, num_image_tokens=NUM_IMAGE_TOKENS, add_special_token=False, pad_token_id=None,
                 eos_token_id=EOS):
        self.num_image_tokens = num_image_tokens
        self.add_special_token = add_special_token
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id

    @property
    def image_id(self):
        return IMAGE_ID

    @property
    def pad_id(self):
        pad_id = self.pad_token_id
        if pad_id is None:
            pad_id = self.eos_token_id
        return pad_id

    def add_image_token(self, image_indices, input_ids):
        input_slices = []

        start = 0
        for index in image_indices:
            if self.add_special_token:
                end = index + 1
            else:
                end = index

            # original text tokens
            input_slices.append(input_ids[start:end])

            # add image tokens, and set the mask as False
            input_slices.append(self.image_id * torch.ones((self.num_image_tokens,), dtype=torch.long))
            start = index + 1

        # the left part
        input_slices.append(input_ids[start:])

        # concat all slices
        input_ids = torch.cat(input_slices, dim=0)
        num_image_tokens = torch.IntTensor([self.num_image_tokens] * len(image_indices))

        return input_ids, num_image_tokens

    def process_one(self, token_ids, images):
        input_ids = torch.LongTensor(token_ids)

        # add image tokens to the input_ids
        image_token_mask = input_ids == self.image_id
        image_indices = image_token_mask.nonzero()
        input_ids, num_image_tokens = self.add_image_token(image_indices=image_indices, input_ids=input_ids)

        pixel_values = torch.stack(images) if len(images) else torch.zeros((0, *self.default_shape))
        return VLChatProcessorOutput(
            sft_format=" ".join(map(str, token_ids)),
            input_ids=input_ids,
            pixel_values=pixel_values,
            num_image_tokens=num_image_tokens,
        )

    def batchify(self, prepare_list):
        batch_size = len(prepare_list)
        sft_format = []
        n_images = []
        seq_lens = []
        for prepare in prepare_list:
            n_images.append(len(prepare.num_image_tokens))
            seq_lens.append(len(prepare))

        input_token_max_len = max(seq_lens)
        max_n_images = max(1, max(n_images))

        batched_input_ids = torch.full((batch_size, input_token_max_len), self.pad_id).long()  # FIXME
        batched_attention_mask = torch.zeros((batch_size, input_token_max_len)).long()
        batched_pixel_values = torch.zeros((batch_size, max_n_images, *self.default_shape)).float()
        batched_images_seq_mask = torch.zeros((batch_size, input_token_max_len)).bool()
        batched_images_emb_mask = torch.zeros((batch_size, max_n_images, self.num_image_tokens)).bool()

        for i, prepare in enumerate(prepare_list):
            input_ids = prepare.input_ids
            seq_len = len(prepare)
            n_image = len(prepare.num_image_tokens)
            # left-padding
            batched_attention_mask[i, -seq_len:] = 1
            batched_input_ids[i, -seq_len:] = torch.LongTensor(input_ids)
            batched_images_seq_mask[i, -seq_len:] = input_ids == self.image_id

            if n_image > 0:
                batched_pixel_values[i, :n_image] = prepare.pixel_values
                for j, n_image_tokens in enumerate(prepare.num_image_tokens):
                    batched_images_emb_mask[i, j, :n_image_tokens] = True

            sft_format.append(prepare.sft_format)

        return BatchedVLChatProcessorOutput(
            input_ids=batched_input_ids,
            attention_mask=batched_attention_mask,
            pixel_values=batched_pixel_values,
            images_seq_mask=batched_images_seq_mask,
            images_emb_mask=batched_images_emb_mask,
            sft_format=sft_format,
        )


# ---------------------------------------------------------------- clip_encoder.py / projector.py


class CLIPVisionTower(nn.Module):

    def __init__(self, vision_config: CLIPVisionConfig, select_feature="patch", select_layer=-2):
        super().__init__()
        self.select_feature = select_feature
        self.select_layer = select_layer
        # huggingface branch of build_vision_tower (built from its config here, not from_pretrained)
        self.vision_tower = CLIPVisionModel(vision_config)
        self.forward_kwargs = dict(output_hidden_states=True)
        self.image_norm = None

    def feature_select(self, image_forward_outs):
        if isinstance(image_forward_outs, torch.Tensor):
            image_features = image_forward_outs
        else:
            image_features = image_forward_outs.hidden_states[self.select_layer]

        if self.select_feature == "patch":
            # if the output has cls_token
            image_features = image_features[:, 1:]
        elif self.select_feature in ("cls_patch", "same"):
            image_features = image_features
        else:
            raise ValueError(f"Unexpected select feature: {self.select_feature}")
        return image_features

    def forward(self, images):
        if self.image_norm is not None:
            images = self.image_norm(images)
        image_forward_outs = self.vision_tower(images, **self.forward_kwargs)
        return self.feature_select(image_forward_outs)


class MlpProjector(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        mlp_depth = cfg["depth"]
        modules = [nn.Linear(cfg["input_dim"], cfg["n_embed"])]
        for _ in range(1, mlp_depth):
            modules.append(nn.GELU())
            modules.append(nn.Linear(cfg["n_embed"], cfg["n_embed"]))
        self.layers = nn.Sequential(*modules)

    def forward(self, x):
        return self.layers(x)


# ---------------------------------------------------------------- modeling_vlm.py


class MultiModalityConfig(PretrainedConfig):
    model_type = "multi_modality"

    def __init__(self, vision_config=None, aligner_config=None, language_config=None, **kwargs):
        super().__init__(**kwargs)
        self.vision_config = vision_config if vision_config is not None else CLIPVisionConfig()
        self.aligner_config = aligner_config if aligner_config is not None else {}
        if isinstance(language_config, LlamaConfig):
            self.language_config = language_config
        else:
            self.language_config = LlamaConfig(**(language_config or {}))


class MultiModalityCausalLM(PreTrainedModel):
    config_class = MultiModalityConfig
    base_model_prefix = "multi_modality"

    def __init__(self, config: MultiModalityConfig):
        super().__init__(config)
        self.vision_model = CLIPVisionTower(config.vision_config)
        self.aligner = MlpProjector(config.aligner_config)
        self.language_model = LlamaForCausalLM(config.language_config)

    def prepare_inputs_embeds(self, input_ids, pixel_values, images_seq_mask, images_emb_mask, **kwargs):
        bs, n = pixel_values.shape[0:2]
        images = pixel_values.reshape(bs * n, *pixel_values.shape[2:])  # "b n c h w -> (b n) c h w"
        # [b x n, T2, D]
        images_embeds = self.aligner(self.vision_model(images))

        # [b x n, T2, D] -> [b, n x T2, D]
        images_embeds = images_embeds.reshape(bs, n * images_embeds.shape[1], images_embeds.shape[2])
        # [b, n, T2] -> [b, n x T2]
        images_emb_mask = images_emb_mask.reshape(bs, -1)

        # [b, T, D]
        input_ids[input_ids < 0] = 0  # ignore the image embeddings
        inputs_embeds = self.language_model.get_input_embeddings()(input_ids)

        # replace with the image embeddings
        inputs_embeds[images_seq_mask] = images_embeds[images_emb_mask]

        return inputs_embeds


# ---------------------------------------------------------------- serve/inference.py


@torch.inference_mode()
def generate(vl_gpt, prepare_inputs, max_gen_len=6):
    inputs_embeds = vl_gpt.prepare_inputs_embeds(**prepare_inputs)
    generation_config = dict(
        inputs_embeds=inputs_embeds,
        attention_mask=prepare_inputs.attention_mask,
        pad_token_id=EOS,
        bos_token_id=BOS,
        eos_token_id=None,  # run the full max_new_tokens so every row is compared over all of them
        max_new_tokens=max_gen_len,
        do_sample=False,
        use_cache=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return vl_gpt.language_model.generate(**generation_config)


def main():
    hidden = 32
    vision_config = CLIPVisionConfig(
        hidden_size=24, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, num_channels=3,
    )
    language_config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None,
    )
    language_config._attn_implementation = "sdpa"
    config = MultiModalityConfig(
        vision_config=vision_config,
        aligner_config={"projector_type": "mlp_gelu", "depth": 2, "input_dim": 24, "n_embed": hidden},
        language_config=language_config,
    )
    vl_gpt = MultiModalityCausalLM(config).eval()
    with torch.no_grad():
        # random init is tiny; give the LM some spread so greedy choices are well separated
        for p in vl_gpt.language_model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)

    processor = VLChatProcessor()

    def img():
        return torch.randn(3, IMAGE_SIZE, IMAGE_SIZE)

    # "User: <image_placeholder> ... Assistant:" as token ids (the sft template already applied)
    conv_a = ([BOS, 5, 6, IMAGE_ID, 7, 8, 9], [img()])
    conv_b = ([BOS, 5, 6, IMAGE_ID, 10, 11, IMAGE_ID, 12, 13, 14, 15, 16, 17, 9], [img(), img()])
    conv_c = ([BOS, 5, 20, 21, 22, 9], [])

    batches = [[conv_a, conv_b], [conv_b, conv_c, conv_a]]
    for convs in batches:
        prepares = [processor.process_one(ids, images) for ids, images in convs]
        batched = processor.batchify(prepares)
        out = generate(vl_gpt, batched)
        first_scores = out.scores[0]
        new_tokens = out.sequences[:, -len(out.scores):]

        for i, (ids, images) in enumerate(convs):
            alone = processor.batchify([processor.process_one(ids, images)])
            assert alone.attention_mask.all()
            ref = generate(vl_gpt, alone)
            ref_tokens = ref.sequences[:, -len(ref.scores):]
            assert torch.equal(new_tokens[i], ref_tokens[0]), (i, new_tokens[i], ref_tokens[0])
            torch.testing.assert_close(first_scores[i], ref.scores[0][0], atol=1e-4, rtol=1e-4)
        print("batch of", len(convs), "rows, lengths", [len(p) for p in prepares], "->", new_tokens.tolist())

    print("ok: left-padded batched generation matches each conversation alone")


if __name__ == "__main__":
    main()
