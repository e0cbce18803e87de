#!/usr/bin/env bash
# Build the local container base image for optiserve bentos, without any image registry.
#
#   deploy/base-image/build.sh [--force] [--image NAME] [--mirror URL] [--no-upgrade] [--no-verify]
#   deploy/base-image/build.sh --print-mirror     # the mirrors it would use, then exit
#
# Debian trixie (Python 3.13) + python3, python3-pip, python3-venv, ca-certificates,
# bootstrapped with debootstrap (--variant=minbase) from the Debian mirror that apt on this
# host already uses (read from $OPTISERVE_APT_DIR, default /etc/apt: sources.list,
# sources.list.d/*.list and *.sources; DEBIAN_MIRROR or --mirror override it), then turned
# into an image with `podman import`.
#
# What the image carries beyond a plain rootfs, and why:
#   * the build host's CA bundle merged into the image's bundle (package traffic may pass a
#     TLS-intercepting proxy); SSL_CERT_FILE, PIP_CERT, REQUESTS_CA_BUNDLE point at it and
#     UV_NATIVE_TLS=1 makes uv use it too. The added certificates are also kept in
#     /usr/local/share/ca-certificates/, so a later `update-ca-certificates` keeps them.
#     Debian CAs that the image's updated ca-certificates dropped on purpose are not re-added;
#   * trixie-updates and trixie-security applied (--no-upgrade skips that);
#   * no /usr/lib/python3.13/EXTERNALLY-MANAGED, so BentoML's `pip install uv` step runs;
#   * docs, man pages and translations removed, plus a dpkg filter that keeps later
#     `apt-get install` steps (BentoML's Dockerfile) from bringing them back.
#
# Idempotent: when the image already exists it does nothing, unless --force is given.
# Needs root (debootstrap, chroot). Installs debootstrap, podman, buildah and runc if missing.
set -euo pipefail

# Trixie rather than bookworm for its Python: on 3.12+ the service runs new tasks eagerly, and a
# request refused at the door is answered a turn of the event loop sooner (serving/process.py).
IMAGE="${OPTISERVE_BASE_IMAGE:-localhost/optiserve-base:trixie}"
SUITE=trixie
PYTHON_VERSION=3.13
PACKAGES=python3,python3-pip,python3-venv,ca-certificates
MIRROR="${DEBIAN_MIRROR:-}"
APT_DIR="${OPTISERVE_APT_DIR:-/etc/apt}"
FORCE=0
PRINT_MIRROR=0
UPGRADE=1
VERIFY=1
# Flags that make podman run containers on these machines (no systemd, nested sandbox).
RUN_FLAGS=(--runtime runc --cgroup-manager=cgroupfs
           --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --network host)

log() { printf '[base-image] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
    sed -n '2,/^set -euo pipefail$/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) FORCE=1 ;;
        --image) [[ $# -ge 2 ]] || die "--image needs a value"; IMAGE="$2"; shift ;;
        --mirror) [[ $# -ge 2 ]] || die "--mirror needs a value"; MIRROR="$2"; shift ;;
        --no-upgrade) UPGRADE=0 ;;
        --no-verify) VERIFY=0 ;;
        --print-mirror) PRINT_MIRROR=1 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument: $1 (try --help)" ;;
    esac
    shift
done

ensure_tools() {
    local missing=()
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    command -v podman >/dev/null 2>&1 || missing+=(podman)
    command -v buildah >/dev/null 2>&1 || missing+=(buildah)
    # The run flags below name runc; Debian's podman pulls in crun only.
    command -v runc >/dev/null 2>&1 || missing+=(runc)
    if [[ ${#missing[@]} -gt 0 ]]; then
        log "installing ${missing[*]} with apt-get"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
}

# Print "URI<TAB>SUITE" for every deb entry apt on this host uses, one-line (.list) and
# deb822 (.sources) formats alike. Files apt ignores (other extensions) are skipped.
apt_entries() {
    local f
    for f in "$APT_DIR/sources.list" "$APT_DIR"/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        awk '
            /^[[:space:]]*#/ { next }
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while ($i !~ /\]$/ && i < NF) i++; i++ }
                if (i + 1 <= NF) print $i "\t" $(i + 1)
            }' "$f"
    done
    for f in "$APT_DIR"/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        awk '
            function flush(   n, m, u, s, i, j) {
                if (types ~ /(^|[[:space:]])deb([[:space:]]|$)/ && enabled !~ /^[[:space:]]*no/) {
                    n = split(uris, u, /[[:space:]]+/); m = split(suites, s, /[[:space:]]+/)
                    for (i = 1; i <= n; i++) for (j = 1; j <= m; j++)
                        if (u[i] != "" && s[j] != "") print u[i] "\t" s[j]
                }
                types = uris = suites = enabled = ""
            }
            /^[[:space:]]*#/ { next }
            /^[[:space:]]*$/ { flush(); next }
            tolower($1) == "types:"   { sub(/^[^:]*:[[:space:]]*/, ""); types = $0 }
            tolower($1) == "uris:"    { sub(/^[^:]*:[[:space:]]*/, ""); uris = $0 }
            tolower($1) == "suites:"  { sub(/^[^:]*:[[:space:]]*/, ""); suites = $0 }
            tolower($1) == "enabled:" { sub(/^[^:]*:[[:space:]]*/, ""); enabled = tolower($0) }
            END { flush() }' "$f"
    done
}

# The mirror for a suite: the first URI apt uses for that very suite; else (a host on another
# Debian release) the first URI whose path ends like the fallback's (/debian,
# /debian-security), since a Debian mirror carries every release; else the fallback.
mirror_for() {
    local suite="$1" fallback="$2" uri
    uri="$(apt_entries | awk -F'\t' -v s="$suite" -v tail="/${fallback##*/}" '
        { u = $1; sub(/\/+$/, "", u) }
        $2 == s && exact == "" { exact = u }
        substr(u, length(u) - length(tail) + 1) == tail && same == "" { same = u }
        END { print (exact != "" ? exact : same) }')"
    printf '%s\n' "${uri:-$fallback}"
}

# One line per certificate in a PEM bundle: its base64 body joined, to compare certificates.
pem_bodies() {
    awk '/-----BEGIN CERTIFICATE-----/ { body = ""; inside = 1; next }
         /-----END CERTIFICATE-----/   { print body; inside = 0; next }
         inside { gsub(/[[:space:]]/, ""); body = body $0 }' "$1"
}

MIRROR="${MIRROR:-$(mirror_for "$SUITE" http://deb.debian.org/debian)}"
SECURITY_MIRROR="$(mirror_for "$SUITE-security" http://deb.debian.org/debian-security)"
if [[ "$PRINT_MIRROR" -eq 1 ]]; then
    printf '%s %s\n' "$SUITE" "$MIRROR" "$SUITE-security" "$SECURITY_MIRROR"
    exit 0
fi

[[ "$(id -u)" -eq 0 ]] || die "run as root (debootstrap and chroot need it)"
ensure_tools

if [[ "$FORCE" -eq 0 ]] && podman image exists "$IMAGE"; then
    log "$IMAGE already exists; nothing to do (pass --force to rebuild)"
    exit 0
fi

START=$SECONDS
log "image $IMAGE from $MIRROR ($SUITE, security: $SECURITY_MIRROR)"

WORK="$(mktemp -d /var/tmp/optiserve-base.XXXXXX)"
ROOTFS="$WORK/rootfs"
cleanup() {
    local m
    for m in proc sys dev/pts; do
        if mountpoint -q "$ROOTFS/$m" 2>/dev/null; then umount -l "$ROOTFS/$m" || true; fi
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

log "debootstrap --variant=minbase (about a minute)"
debootstrap --variant=minbase --components=main --include="$PACKAGES" \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
    tail -n 40 "$WORK/debootstrap.log" >&2
    die "debootstrap failed"
}

cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF

# Keep docs, man pages and translations out of every later package install too
# (the same filter Debian's official slim images use); copyright files stay.
mkdir -p "$ROOTFS/etc/dpkg/dpkg.cfg.d"
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/01-optiserve-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
EOF

mount -t proc proc "$ROOTFS/proc"
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"
chmod +x "$ROOTFS/usr/sbin/policy-rc.d"
in_root() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 "$@"; }
if [[ "$UPGRADE" -eq 1 ]]; then
    # debootstrap only reads the release suite; security fixes (openssl, python3,
    # ca-certificates, ...) come from these two.
    log "applying $SUITE-updates and $SUITE-security"
    if ! { in_root apt-get update -q &&
           in_root apt-get -y -q -o Dpkg::Options::=--force-confold upgrade; } >"$WORK/upgrade.log" 2>&1; then
        tail -n 40 "$WORK/upgrade.log" >&2
        die "apt-get upgrade inside the rootfs failed (retry with --no-upgrade to skip it)"
    fi
fi

# Trust what the build host trusts (a TLS-intercepting proxy's CA, a company CA): every
# certificate of the host's bundle that the image's bundle lacks is appended to it and
# kept in /usr/local/share/ca-certificates, so a later update-ca-certificates (BentoML's
# apt step can run one) keeps it. Certificates that the host's own Debian ca-certificates
# package ships are left out: when the image lacks one of those, its newer ca-certificates
# dropped that CA on purpose (distrusted), and re-adding it would undo a security update.
HOST_BUNDLE=/etc/ssl/certs/ca-certificates.crt
IMAGE_BUNDLE="$ROOTFS/etc/ssl/certs/ca-certificates.crt"
[[ -s "$HOST_BUNDLE" ]] || die "no CA bundle on the build host at $HOST_BUNDLE"
[[ -s "$IMAGE_BUNDLE" ]] || die "the rootfs has no CA bundle at $IMAGE_BUNDLE"
pem_bodies "$IMAGE_BUNDLE" | sort -u >"$WORK/image-certs.txt"
: >"$WORK/host-distro-certs.txt"
if [[ -d /usr/share/ca-certificates ]]; then
    find /usr/share/ca-certificates -name '*.crt' -type f -print0 |
        while IFS= read -r -d '' f; do pem_bodies "$f"; done | sort -u >"$WORK/host-distro-certs.txt"
fi
LOCAL_CA_DIR="$ROOTFS/usr/local/share/ca-certificates/build-host"
mkdir -p "$LOCAL_CA_DIR"
: >"$WORK/added-certs.txt"
added=0 skipped=0
while IFS= read -r body; do
    grep -qxF -- "$body" "$WORK/image-certs.txt" && continue
    if grep -qxF -- "$body" "$WORK/host-distro-certs.txt"; then
        skipped=$((skipped + 1))
        continue
    fi
    added=$((added + 1))
    crt="$LOCAL_CA_DIR/build-host-$(printf '%03d' "$added").crt"
    {
        echo "-----BEGIN CERTIFICATE-----"
        fold -w 64 <<<"$body"
        echo "-----END CERTIFICATE-----"
    } >"$crt"
    cat "$crt" >>"$IMAGE_BUNDLE"
    printf '%s\n' "$body" >>"$WORK/added-certs.txt"
done < <(pem_bodies "$HOST_BUNDLE" | sort -u)
log "added $added certificate(s) of the build host's CA bundle" \
    "($skipped left out: Debian CAs that the image's newer ca-certificates dropped)"
# Rebuild the bundle the way Debian does, and check that the added certificates are in it.
in_root update-ca-certificates >"$WORK/update-ca.log" 2>&1 || {
    cat "$WORK/update-ca.log" >&2
    die "update-ca-certificates failed in the rootfs"
}
pem_bodies "$IMAGE_BUNDLE" | sort -u >"$WORK/image-certs.txt"
lacking="$(sort -u "$WORK/added-certs.txt" | comm -23 - "$WORK/image-certs.txt")"
[[ -z "$lacking" ]] || die "the image's CA bundle lost certificates taken from the build host"
in_root apt-get clean
umount "$ROOTFS/proc"
rm -f "$ROOTFS/usr/sbin/policy-rc.d"

log "trimming"
rm -f "$ROOTFS/usr/lib/python$PYTHON_VERSION/EXTERNALLY-MANAGED"
find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/lintian/*
find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/var/cache/debconf/*-old "$ROOTFS"/var/lib/dpkg/*-old \
    "$ROOTFS"/var/log/* "$ROOTFS"/tmp/* "$ROOTFS"/var/tmp/* "$ROOTFS"/root/.cache
rm -f "$ROOTFS/etc/resolv.conf" "$ROOTFS/etc/hostname"
[[ -x "$ROOTFS/usr/bin/python$PYTHON_VERSION" ]] || die "python$PYTHON_VERSION missing from the rootfs"

log "podman import"
old_id="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
BUNDLE=/etc/ssl/certs/ca-certificates.crt
tar --numeric-owner --xattrs -C "$ROOTFS" \
    --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* --exclude=./run/* \
    -cf - . |
    podman import --quiet \
        --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --change "ENV LANG=C.UTF-8" \
        --change "ENV SSL_CERT_FILE=$BUNDLE" \
        --change "ENV PIP_CERT=$BUNDLE" \
        --change "ENV REQUESTS_CA_BUNDLE=$BUNDLE" \
        --change "ENV UV_NATIVE_TLS=1" \
        --change "LABEL org.opencontainers.image.title=optiserve-base" \
        --change "LABEL org.opencontainers.image.description=Debian $SUITE minbase + python3 for optiserve bentos" \
        --change 'CMD ["/bin/bash"]' \
        --message "debootstrap $SUITE minbase from $MIRROR" \
        - "$IMAGE" >/dev/null
new_id="$(podman image inspect --format '{{.Id}}' "$IMAGE")"
if [[ -n "$old_id" && "$old_id" != "$new_id" ]]; then
    podman rmi "$old_id" >/dev/null 2>&1 || log "old image $old_id still in use; left in place"
fi

if [[ "$VERIFY" -eq 1 ]]; then
    log "verifying: python3, ssl, venv, no EXTERNALLY-MANAGED, pip through the proxy"
    podman run --rm "${RUN_FLAGS[@]}" "$IMAGE" python3 -c \
        "import os, ssl, sys, venv; assert sys.version.startswith('$PYTHON_VERSION.'), sys.version;
assert not os.path.exists('/usr/lib/python$PYTHON_VERSION/EXTERNALLY-MANAGED'); print('python ok')"
    podman run --rm "${RUN_FLAGS[@]}" "$IMAGE" sh -c \
        'd=$(mktemp -d) && python3 -m pip download -q --no-deps -d "$d" six && ls "$d"'
fi

size="$(podman image inspect --format '{{.Size}}' "$IMAGE")"
log "built $IMAGE: $((size / 1000000)) MB, $((SECONDS - START)) s"
