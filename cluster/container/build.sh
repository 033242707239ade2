#!/usr/bin/env bash
# Build the srpo_megatron GPU image from the one version table, and optionally import it for pyxis.
#
#   cluster/container/build.sh                     docker build -> srpo-megatron:<versions>
#   cluster/container/build.sh --sqsh FILE.sqsh    ... then `enroot import` it into FILE.sqsh
#                                                  (the container_image of your cluster file)
#
# Every KEY=VALUE line of versions.env becomes a `--build-arg`; the Dockerfile has no defaults, so the
# table is the only place a version is set.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
sqsh=""
if [[ "${1:-}" == "--sqsh" ]]; then sqsh="${2:?--sqsh needs a file path}"; fi

args=()
while IFS= read -r line; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  args+=(--build-arg "$line")
done < "$here/versions.env"
set -a; source "$here/versions.env"; set +a
tag="srpo-megatron:sglang${SGLANG_VERSION}-${SGLANG_CUDA}-te${TRANSFORMER_ENGINE_VERSION}-mcore${MEGATRON_CORE_VERSION}"

DOCKER_BUILDKIT=1 docker build -f "$here/Dockerfile" "${args[@]}" -t "$tag" "$repo"
echo "built $tag"
if [[ -n "$sqsh" ]]; then
  enroot import -o "$sqsh" "dockerd://$tag"
  echo "imported $sqsh"
fi
