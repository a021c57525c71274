"""cosyvoice3.yaml for generated checkpoints.

The structure (class tags, key order, GAN/dataset sections, seed lines) follows the official
example ``examples/libritts/cosyvoice3/conf/cosyvoice3.yaml`` so that any HyperPyYAML reader
that accepts the real file accepts ours; only the numbers that define a model size are
placeholders.  ``string.Template`` is used because the yaml itself contains no ``$``.
"""

from __future__ import annotations

from string import Template

from cosybatch.models.config import ModelConfig

_TEMPLATE = Template(
    """\
# cosybatch generated checkpoint config (size $size, seed $seed): the official
# examples/libritts/cosyvoice3/conf/cosyvoice3.yaml structure with these numbers.
# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: $sample_rate
llm_input_size: $llm_input_size
llm_output_size: $llm_output_size
spk_embed_dim: $spk_embed_dim
qwen_pretrain_path: ''
token_frame_rate: $token_frame_rate
token_mel_ratio: $token_mel_ratio

# stream related params
chunk_size: $chunk_size # streaming inference chunk size, in token
num_decoding_left_chunks: -1 # streaming inference flow decoder left chunk size, <0 means use all left chunks

# model params
# for all class/function included in this repo, we use !<name> or !<new> for intialization, so that user may find all corresponding class/function according to one single yaml.
# for system/third_party class/function, we do not require this.
llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: $speech_token_size
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: $top_p
        top_k: $top_k
        win_size: $win_size
        tau_r: $tau_r

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: $flow_input_size
    output_size: $flow_output_size
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: $flow_vocab_size
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: $pre_lookahead_len
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: $flow_input_size
        channels: $pre_lookahead_channels
        pre_lookahead_len: $pre_lookahead_len
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: $flow_output_size
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: $sigma_min
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: $inference_cfg_rate
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: $dit_dim
            depth: $dit_depth
            heads: $dit_heads
            dim_head: $dit_dim_head
            ff_mult: $dit_ff_mult
            mel_dim: $dit_mel_dim
            mu_dim: $dit_mu_dim
            spk_dim: $dit_spk_dim
            out_channels: $dit_out_channels
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: $hift_in_channels
    base_channels: $hift_base_channels
    nb_harmonics: $nb_harmonics
    sampling_rate: !ref <sample_rate>
    nsf_alpha: $nsf_alpha
    nsf_sigma: $nsf_sigma
    nsf_voiced_threshold: $nsf_voiced_threshold
    upsample_rates: $upsample_rates
    upsample_kernel_sizes: $upsample_kernel_sizes
    istft_params:
        n_fft: $n_fft
        hop_len: $hop_len
    resblock_kernel_sizes: $resblock_kernel_sizes
    resblock_dilation_sizes: $resblock_dilation_sizes
    source_resblock_kernel_sizes: $source_resblock_kernel_sizes
    source_resblock_dilation_sizes: $source_resblock_dilation_sizes
    lrelu_slope: $lrelu_slope
    audio_limit: $audio_limit
    conv_pre_look_right: $conv_pre_look_right
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: $f0_num_class
        in_channels: $f0_in_channels
        cond_channels: $f0_cond_channels

# gan related module
mel_spec_transform1: !name:matcha.utils.audio.mel_spectrogram
    n_fft: $mel_n_fft
    num_mels: $mel_num_mels
    sampling_rate: !ref <sample_rate>
    hop_size: $mel_hop_size
    win_size: $mel_win_size
    fmin: $mel_fmin
    fmax: $mel_fmax
    center: $mel_center
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResSpecDiscriminator
    mel_spec_transform: [
        !ref <mel_spec_transform1>
    ]

# processor functions
parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
tokenize: !name:cosyvoice.dataset.processor.tokenize
    get_tokenizer: !ref <get_tokenizer>
    allowed_special: !ref <allowed_special>
filter: !name:cosyvoice.dataset.processor.filter
    max_length: 6000
    min_length: 100
    token_max_length: 200
    token_min_length: 1
resample: !name:cosyvoice.dataset.processor.resample
    resample_rate: !ref <sample_rate>
truncate: !name:cosyvoice.dataset.processor.truncate
    truncate_length: 24960 # must be a multiplier of hop_size and token_mel_ratio
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: $mel_n_fft
    num_mels: $mel_num_mels
    sampling_rate: !ref <sample_rate>
    hop_size: $mel_hop_size
    win_size: $mel_win_size
    fmin: $mel_fmin
    fmax: $mel_fmax
    center: $mel_center
compute_fbank: !name:cosyvoice.dataset.processor.compute_fbank
    feat_extractor: !ref <feat_extractor>
    num_frames: 960
compute_whisper_fbank: !name:cosyvoice.dataset.processor.compute_whisper_fbank
    num_frames: 960
compute_f0: !name:cosyvoice.dataset.processor.compute_f0
    sample_rate: !ref <sample_rate>
    hop_size: $mel_hop_size
parse_embedding: !name:cosyvoice.dataset.processor.parse_embedding
    normalize: True
shuffle: !name:cosyvoice.dataset.processor.shuffle
    shuffle_size: 1000
sort: !name:cosyvoice.dataset.processor.sort
    sort_size: 500  # sort_size should be less than shuffle_size
batch: !name:cosyvoice.dataset.processor.batch
    batch_type: 'dynamic'
    max_frames_in_batch: 2000
padding: !name:cosyvoice.dataset.processor.padding
    use_spk_embedding: False # change to True during sft


# dataset processor pipeline
data_pipeline: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <compute_fbank>,
    !ref <parse_embedding>,
    !ref <compute_whisper_fbank>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]
data_pipeline_gan: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <truncate>,
    !ref <compute_fbank>,
    !ref <compute_f0>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]

# llm flow train conf
train_conf:
    optim: adam
    optim_conf:
        lr: 1e-5 # change to 1e-5 during sft
    scheduler: constantlr # change to constantlr during sft
    scheduler_conf:
        warmup_steps: 2500
    max_epoch: 200
    grad_clip: 5
    accum_grad: 2
    log_interval: 100
    save_per_step: -1

# gan train conf
train_conf_gan:
    optim: adam
    optim_conf:
        lr: 0.0002 # use small lr for gan training
    scheduler: constantlr
    optim_d: adam
    optim_conf_d:
        lr: 0.0002 # use small lr for gan training
    scheduler_d: constantlr
    max_epoch: 200
    grad_clip: 5
    accum_grad: 1 # in gan training, accum_grad must be 1
    log_interval: 100
    save_per_step: -1
"""
)


def _num(x) -> str:
    """YAML scalar the way the official file spells numbers (10 not 10.0, 1e-06 for tiny floats)."""
    if isinstance(x, bool):
        return "True" if x else "False"
    if x is None:
        return "null"
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return repr(x)


def _flow_list(xs) -> str:
    """Flow-style list: ``[8, 5, 3]`` / ``[[1, 3, 5], [1, 3, 5]]``."""
    if isinstance(xs, (list, tuple)):
        return "[" + ", ".join(_flow_list(x) for x in xs) + "]"
    return _num(xs)


def render_yaml(cfg: ModelConfig, size: str, seed: int) -> str:
    """The cosyvoice3.yaml text for ``cfg``."""
    llm, flow, dit, hift, mel = cfg.llm, cfg.flow, cfg.flow.dit, cfg.hift, cfg.mel
    if dit.static_chunk_size != cfg.chunk_size * flow.token_mel_ratio:
        raise ValueError("DiT static_chunk_size must equal chunk_size * token_mel_ratio")
    s = llm.sampling
    values = dict(
        size=size,
        seed=seed,
        sample_rate=cfg.sample_rate,
        llm_input_size=llm.llm_input_size,
        llm_output_size=llm.llm_output_size,
        spk_embed_dim=flow.spk_embed_dim,
        token_frame_rate=cfg.token_frame_rate,
        token_mel_ratio=flow.token_mel_ratio,
        chunk_size=cfg.chunk_size,
        speech_token_size=llm.speech_token_size,
        top_p=_num(float(s.top_p)),
        top_k=s.top_k,
        win_size=s.win_size,
        # tau_r is spelled as a float (``2.0``, ``0.1``) like the official/fixture yaml
        tau_r=repr(float(s.tau_r)),
        flow_input_size=flow.input_size,
        flow_output_size=flow.output_size,
        flow_vocab_size=flow.vocab_size,
        pre_lookahead_len=flow.pre_lookahead_len,
        pre_lookahead_channels=flow.pre_lookahead_channels,
        sigma_min=_num(flow.sigma_min),
        inference_cfg_rate=_num(flow.inference_cfg_rate),
        dit_dim=dit.dim,
        dit_depth=dit.depth,
        dit_heads=dit.heads,
        dit_dim_head=dit.dim_head,
        dit_ff_mult=dit.ff_mult,
        dit_mel_dim=dit.mel_dim,
        dit_mu_dim=dit.mu_dim,
        dit_spk_dim=dit.spk_dim,
        dit_out_channels=dit.out_channels,
        hift_in_channels=hift.in_channels,
        hift_base_channels=hift.base_channels,
        nb_harmonics=hift.nb_harmonics,
        nsf_alpha=_num(hift.nsf_alpha),
        nsf_sigma=_num(hift.nsf_sigma),
        nsf_voiced_threshold=_num(hift.nsf_voiced_threshold),
        upsample_rates=_flow_list(hift.upsample_rates),
        upsample_kernel_sizes=_flow_list(hift.upsample_kernel_sizes),
        n_fft=hift.n_fft,
        hop_len=hift.hop_len,
        resblock_kernel_sizes=_flow_list(hift.resblock_kernel_sizes),
        resblock_dilation_sizes=_flow_list(hift.resblock_dilation_sizes),
        source_resblock_kernel_sizes=_flow_list(hift.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=_flow_list(hift.source_resblock_dilation_sizes),
        lrelu_slope=_num(hift.lrelu_slope),
        audio_limit=_num(hift.audio_limit),
        conv_pre_look_right=hift.conv_pre_look_right,
        f0_num_class=hift.f0_num_class,
        f0_in_channels=hift.f0_in_channels,
        f0_cond_channels=hift.f0_cond_channels,
        mel_n_fft=mel.n_fft,
        mel_num_mels=mel.num_mels,
        mel_hop_size=mel.hop_size,
        mel_win_size=mel.win_size,
        mel_fmin=_num(mel.fmin),
        mel_fmax=_num(mel.fmax),
        mel_center=_num(mel.center),
    )
    return _TEMPLATE.substitute(values)
