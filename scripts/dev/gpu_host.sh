#!/usr/bin/env bash
# On the lent GPU machine: the figures behind the decode step's speed and compile time. PARTS picks what runs
# (space-separated, in this order; default "attn step generate", about 10 minutes: split it over device calls):
#   attn      attention only at 512K, both model shapes, r8i4/r4i4/r2i4 at batch 1 and 8, from a fresh Triton
#             cache (the cold run's wall time is printed: its compiles included);  ~2 min
#   attn1m    the same at 1M, batch 1;  ~2 min
#   step      the complete GLM-4-9B step at 512K captured by hand in one CUDA graph (`--graphs compile-cuda`):
#             r4i4, r8i4, dense and the step less its attention (against the weights' read floor) in one run;  ~5 min
#   fusedstep the same step on GLM-4-9B's own four projections a layer (`--shape glm4-9b-fused`: q/k/v in one, gate
#             and up in one): r4i4, r8i4, dense and the step less its attention;  ~5 min
#   gemvstep  the fusedstep step with the projections on the library's GEMV (`locks_hf.gemv_projections`, arms
#             `+gemv`): r4i4, r8i4 and dense in one run, after the projections alone on cuBLAS and on the GEMV's
#             tiles (scripts/dev/bench_gemv.py);  ~5.5 min
#   llamagemv the complete Llama-3.1-8B step at 512K with the projections on the GEMV: r4i4 and dense in one run
#             (needs more than an H100's 80 GB);  ~4 min
#   llamastep the complete Llama-3.1-8B step at 512K the same way: r4i4, r8i4 and dense in one run (needs more
#             than an H100's 80 GB);  ~5 min
#   profile   the GLM-4-9B r4i4 step of `step` with every kernel listed (`--profile 2 --profile-top 0`): kernel time
#             by group (the library's, inductor's, the matrix products) and the time between kernels;  ~2 min
#   pageupdates the gemvstep r4i4 step with the layers' page updates in one launch a step (the default, beside
#             dense), then one launch a layer (LOCKS_HF_GROUP_PAGE_UPDATES=0), then the default with inductor's own
#             options (no combo kernels);  ~7.5 min
#   options   inductor's options for the decode step, one set after another (OPTION_SETS, separated by "|"; default
#             '{}|{"combo_kernels": true}': inductor's defaults, then combo kernels, the step's independent small kernels
#             in one launch): the gemvstep arms (r4i4, r8i4, dense) in one run a set;  ~4.7 min a set
#   llamaoptions the same for the llamagemv arms (r4i4, dense; needs more than an H100's 80 GB at 512K: CTX=256K
#             fits one);  ~4 min a set
#   generateoptions the first generate() at 128K of `decode_compile_config(options)` (arm captured-r4i4) from empty
#             caches for each set of OPTION_SETS, then the last set again with its caches warm: their compile time;
#             ~1.3 min a run
#   gemvprofile the gemvstep r4i4 step and the step less its attention, every kernel listed (`--profile 2
#             --profile-top 0`): the GEMV, the library's kernels and inductor's glue, a layer;  ~2.5 min
#   select    the selection alone at GLM-4-9B's shape, 32,774 pages (512K tokens plus a static cache's headroom: 17
#             chunks) and 32,768: with and without the page mask, and with the merge in one tile against two
#             (`bench_select.py --kernels`);  ~1.5 min
#   host      where `--graphs captured` spends its host time: GLM-4-9B r4i4 at 512K under cProfile;  ~2 min
#   generate  the one-liner's first generate() at 128K from cold caches, then again with those caches warm:
#             torch.compile's share and the library's Triton compiles by kernel (`triton_compiles`);  ~3 min
#   oneliner  the one-liner against `LocksStaticCache` and transformers' default at 128K in one run, and the one-liner
#             with the projections on the GEMV (`r4i4+gemv`);  ~5 min
#   glmhf     the same step on transformers' GlmForCausalLM (`--shape glm4-9b-hf`: six projections a layer, as
#             THUDM/glm-4-9b-chat-1m-hf loads), every kernel of a compiled r4i4 step listed (`--profile-top 0`);  ~5 min
#   autotune  the GLM-4-9B step of `step` with inductor's max-autotune (Triton GEMV templates against cuBLAS),
#             r4i4 and dense;  ~6 min
#   batch8    the complete step at 512K and batch 8 on 4-bit K/V (a bf16 cache does not fit), GLM-4-9B shape:
#             dense against r4i4 / r8i4 on the same packed K/V, CUDA graph (bench_throughput.py);  ~4 min
#   short     the first generate() of a 4K prompt from cold caches, with the decode kernels compiled in the
#             background and with LOCKS_HF_PRECOMPILE=0 (each from empty caches of its own);  ~2 min
#   gemv      every layer's projections alone (cuBLAS GEMVs in one CUDA graph) in three layouts of GLM-4-9B's
#             weights (seven a layer as --shape glm4-9b, six as GlmForCausalLM, four fused) against their read floor;  ~1 min
#   trace     dynamo's share of compiling one decode step: transformers' StaticCache against LocksCache on the
#             kernels, and a decoder layer marked as a nested compile region (scripts/dev/trace_time.py);  ~1 min
#   quanttile the 4-bit attention kernel alone, every page of 512K at batch 8 (the batch8 dense arm's), GLM-4-9B
#             shape, at 4 and 8 warps and tiles of 1, 2 and 4 pages (fewer registers a thread, more programs an
#             SM: scripts/dev/check_quant_attention_compile.py), against the bf16 kernel;  ~3 min
# e.g. PARTS="attn step" bash scripts/dev/gpu_host.sh, then PARTS="generate host". Tables on stdout, JSON and
# logs under ${OUT:-out}.
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
PARTS=${PARTS:-attn step generate}
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OPTION_SETS=${OPTION_SETS:-'{}|{"combo_kernels": true}'}
options_tag() {  # a JSON object of inductor options -> a file name's part: '{"combo_kernels": true}' -> combo_kernels-true
  python3 -c 'import json, sys; print("_".join(f"{k}-{v}".replace(".", "-").lower() for k, v in json.loads(sys.argv[1]).items()) or "default")' "$1"
}
show() {  # log lines
  grep -v -i "warn" "$1" | tail -"$2" | cut -c1-260
}
run() {  # name timeout command...: logs to $OUT/name.log, prints the exit status and the log's tail
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?, $((SECONDS - start)) s"
  show "$OUT/$name.log" 22
}
for part in $PARTS; do
  case $part in
    attn|attn1m)
      ctx=512K batch=1,8
      [ "$part" = attn1m ] && ctx=1M batch=1
      rm -rf "/tmp/tc_$part"
      TRITON_CACHE_DIR="/tmp/tc_$part" run "decode_attention_$ctx" 200 python3 scripts/bench_decode.py --contexts "$ctx" \
          --batch "$batch" --labels r8i4,r4i4,r2i4 --reps 30 --out "$OUT/decode_attention_$ctx.json" ;;
    step)
      run decode_step_glm4-9b_compile-cuda 330 python3 scripts/bench_decode_step.py --graphs compile-cuda --shape glm4-9b \
          --contexts 512K --arms r4i4,r8i4,full,no-attention --steps 32 --out "$OUT/decode_step_glm4-9b_compile-cuda.json" ;;
    fusedstep)
      run decode_step_glm4-9b-fused_compile-cuda 330 python3 scripts/bench_decode_step.py --graphs compile-cuda \
          --shape glm4-9b-fused --contexts 512K --arms r4i4,r8i4,full,no-attention --steps 32 \
          --out "$OUT/decode_step_glm4-9b-fused_compile-cuda.json" ;;
    gemvstep)
      run gemv_glm4-9b_fused 120 python3 scripts/dev/bench_gemv.py --shape glm4-9b --layout fused --out "$OUT/gemv_glm4-9b_fused.json"
      run decode_step_glm4-9b-fused_gemv 330 python3 scripts/bench_decode_step.py --graphs compile-cuda \
          --shape glm4-9b-fused --contexts 512K --arms r4i4+gemv,r8i4+gemv,full+gemv --steps 32 \
          --out "$OUT/decode_step_glm4-9b-fused_gemv.json" ;;
    llamagemv)
      run decode_step_llama3.1-8b_gemv 330 python3 scripts/bench_decode_step.py --graphs compile-cuda \
          --shape llama3.1-8b --contexts 512K --arms r4i4+gemv,full+gemv --steps 32 \
          --out "$OUT/decode_step_llama3.1-8b_gemv.json" ;;
    llamastep)
      run decode_step_llama3.1-8b_compile-cuda 330 python3 scripts/bench_decode_step.py --graphs compile-cuda \
          --shape llama3.1-8b --contexts 512K --arms r4i4,r8i4,full --steps 32 \
          --out "$OUT/decode_step_llama3.1-8b_compile-cuda.json" ;;
    profile)
      run decode_step_glm4-9b_profile 200 python3 scripts/bench_decode_step.py --graphs compile-cuda --shape glm4-9b \
          --contexts 512K --arms r4i4,no-attention --steps 32 --profile 2 --profile-top 0 \
          --out "$OUT/decode_step_glm4-9b_profile.json" ;;
    pageupdates)
      step=(python3 scripts/bench_decode_step.py --graphs compile-cuda --shape glm4-9b-fused --contexts 512K --steps 32)
      run decode_step_glm4-9b-fused_gemv_grouped_updates 200 "${step[@]}" --arms r4i4+gemv,full+gemv \
          --out "$OUT/decode_step_glm4-9b-fused_gemv_grouped_updates.json"
      LOCKS_HF_GROUP_PAGE_UPDATES=0 run decode_step_glm4-9b-fused_gemv_per_layer_updates 150 "${step[@]}" \
          --arms r4i4+gemv --out "$OUT/decode_step_glm4-9b-fused_gemv_per_layer_updates.json"
      run decode_step_glm4-9b-fused_gemv_grouped_inductor_defaults 150 "${step[@]}" --arms r4i4+gemv \
          --inductor-options '{}' --out "$OUT/decode_step_glm4-9b-fused_gemv_grouped_inductor_defaults.json" ;;
    options|llamaoptions)
      shape=glm4-9b-fused arms=r4i4+gemv,r8i4+gemv,full+gemv limit=280 ctx=512K
      [ "$part" = llamaoptions ] && shape=llama3.1-8b arms=r4i4+gemv,full+gemv limit=240 ctx=${CTX:-512K}
      IFS="|" read -ra sets <<< "$OPTION_SETS"
      for options in "${sets[@]}"; do
        name="decode_step_${shape}_${ctx}_gemv_options_$(options_tag "$options")"
        run "$name" $limit python3 scripts/bench_decode_step.py --graphs compile-cuda --shape $shape --contexts $ctx \
            --arms $arms --steps 32 --inductor-options "$options" --out "$OUT/$name.json"
      done ;;
    generateoptions)
      IFS="|" read -ra sets <<< "$OPTION_SETS"
      for options in "${sets[@]}"; do
        tag=$(options_tag "$options")
        rm -rf "/tmp/tc_$tag" "/tmp/ti_$tag"
        for caches in cold warm; do
          [ "$options" != "${sets[-1]}" ] && [ $caches = warm ] && continue
          TRITON_CACHE_DIR="/tmp/tc_$tag" TORCHINDUCTOR_CACHE_DIR="/tmp/ti_$tag" run "generate_128k_captured_${tag}_$caches" 150 \
              python3 scripts/bench_generate.py --runs 128K:1 --arms captured-r4i4 --inductor-options "$options" \
              --out "$OUT/generate_128k_captured_${tag}_$caches.json"
        done
      done ;;
    gemvprofile)
      run decode_step_glm4-9b-fused_gemv_profile 300 python3 scripts/bench_decode_step.py --graphs compile-cuda \
          --shape glm4-9b-fused --contexts 512K --arms r4i4+gemv,no-attention+gemv --steps 32 --profile 2 --profile-top 0 \
          --out "$OUT/decode_step_glm4-9b-fused_gemv_profile.json" ;;
    select)
      run select_glm4-9b_512k 150 python3 scripts/dev/bench_select.py --kernels --configs glm4-9b:524384:1,glm4-9b:512K:1 \
          --sweep "" --out "$OUT/select_glm4-9b_512k.json" ;;
    glmhf)
      run decode_step_glm4-9b-hf_compile-cuda 330 python3 scripts/bench_decode_step.py --graphs compile-cuda \
          --shape glm4-9b-hf --contexts 512K --arms r4i4,r8i4,full,no-attention --steps 32 --profile 2 --profile-top 0 \
          --out "$OUT/decode_step_glm4-9b-hf_compile-cuda.json" ;;
    host)
      run decode_step_glm4-9b_captured 200 python3 scripts/bench_decode_step.py --graphs captured --shape glm4-9b \
          --contexts 512K --arms r4i4 --steps 10 --host-profile 5 --out "$OUT/decode_step_glm4-9b_captured.json" ;;
    generate)
      rm -rf /tmp/tc_generate /tmp/ti_generate
      for caches in cold warm; do
        TRITON_CACHE_DIR=/tmp/tc_generate TORCHINDUCTOR_CACHE_DIR=/tmp/ti_generate run "generate_128k_$caches" 220 \
            python3 scripts/bench_generate.py --runs 128K:1 --arms r4i4 --out "$OUT/generate_128k_$caches.json"
      done
      python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['rows'][0]; print(json.dumps(r['triton_compiles'], indent=1))" \
          "$OUT/generate_128k_cold.json" | head -40 ;;
    oneliner)
      run generate_128k_oneliner 400 python3 scripts/bench_generate.py --runs 128K:1 --arms static-r4i4,r4i4,r4i4+gemv,hf-dynamic \
          --out "$OUT/generate_128k_oneliner.json" ;;
    autotune)
      run decode_step_glm4-9b_autotune 400 python3 scripts/bench_decode_step.py --graphs compile-cuda --shape glm4-9b \
          --contexts 512K --arms r4i4,full --steps 32 --inductor-options '{"max_autotune": true}' \
          --out "$OUT/decode_step_glm4-9b_autotune.json" ;;
    batch8)
      run throughput_glm4-9b_512k_batch8_kv4 330 python3 scripts/bench_throughput.py --shape glm4-9b --contexts 512K \
          --max-batch 8 --arms full+kv4-post,r4i4+kv4-post,r8i4+kv4-post --out "$OUT/throughput_glm4-9b_512k_batch8_kv4.json" ;;
    short)
      for precompile in 1 0; do
        rm -rf "/tmp/tc_short$precompile" "/tmp/ti_short$precompile"
        LOCKS_HF_PRECOMPILE=$precompile TRITON_CACHE_DIR="/tmp/tc_short$precompile" \
            TORCHINDUCTOR_CACHE_DIR="/tmp/ti_short$precompile" run "generate_4k_cold_precompile$precompile" 150 \
            python3 scripts/bench_generate.py --runs 4K:1 --arms r4i4 --out "$OUT/generate_4k_cold_precompile$precompile.json"
      done ;;
    gemv)
      run gemv_floor_glm4-9b 120 python3 scripts/dev/gemv_floor.py --shape glm4-9b --out "$OUT/gemv_floor_glm4-9b.json" ;;
    trace)
      run trace_time 120 python3 scripts/dev/trace_time.py --device cuda --out "$OUT/trace_time.json" ;;
    quanttile)
      run quant_attention_glm4-9b_512k_batch8_dense 240 python3 scripts/bench_kv_quant.py --shape glm4-9b --batch 8 \
          --contexts 512K --page-sizes 16 --bits 4 --warps 4,8 --tile-pages auto,1,2 --dense --reps 20 \
          --out "$OUT/quant_attention_glm4-9b_512k_batch8_dense.json" ;;
    *) echo "gpu_host: unknown part '$part' (attn attn1m step fusedstep gemvstep llamagemv llamastep profile options llamaoptions generateoptions gemvprofile select glmhf host generate oneliner autotune batch8 short gemv trace quanttile)" >&2; exit 2 ;;
  esac
done
