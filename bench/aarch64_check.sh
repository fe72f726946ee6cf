#!/usr/bin/env bash
# The aarch64 (Raspberry Pi OS 64-bit) check under qemu user emulation; too slow for every CI run.
#
# 1. installs qemu-user-static, binfmt-support and debootstrap, and registers qemu-aarch64 with binfmt_misc
#    (edgefl client starts the agent and the SuperNode, the agent a child process for its partition: every
#    aarch64 binary must run by itself);
# 2. debootstraps Debian bookworm arm64 into --cache (kept, so a rerun skips this), copies the project to
#    /opt/edgefl in it and runs the project's installer there (install.sh: apt, venv, PyPI's aarch64 wheels;
#    the .venv is kept too: --fresh-venv measures a first install);
# 3. runs one small federation as on real devices, over TLS: `edgefl server` on this machine, `edgefl client` in
#    the chroot (which shares this machine's network namespace, so they meet on loopback), each waited for through
#    its --ready-file (written once it serves, once it joined), then `edgefl run --federation remote` (FedAvg,
#    digits, 1 client); checks that every round closed with the client's update. The client's split of the data is
#    made in the chroot first, from the run's own flags, as the submitter's preflight makes it for devices on its
#    machine: under emulation a first message that made it would outlast the server's wait for a node's answer.
# Ends with a PASS/FAIL summary. Needs root. Stops every process it started and removes its mounts on exit;
# whenever it stops early it says why in one line (exit 2).
#
#   bench/aarch64_check.sh [--cache DIR] [--out DIR] [--rounds N] [--local-steps K] [--fresh-venv]
set -Eeuo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=/var/cache/edgefl-aarch64
OUT=$REPO/runs/aarch64-check
ROUNDS=2
LOCAL_STEPS=5
FRESH_VENV=0
HOST_CA=/etc/ssl/certs/ca-certificates.crt
DEVICE_PROJECT=/opt/edgefl
DEVICE_OUT=/root/edgefl-client
RUN_DATA=(--dataset digits --partition iid --clients 1) # edgefl run's, and the client's split made before the run
STARTUP_TIMEOUT_S=900 # the server, the client and its edge agent start in seconds here, in minutes under emulation

usage() { sed -n '2,/^set /s/^# \{0,1\}//p' "$0"; }
die() {
    echo "aarch64_check: error: $*" >&2
    exit 2
}
# A command that failed (set -e) stops the check with its line and status; in a subshell, only the subshell ends
# (the command that ran it fails in turn and is the one named).
on_error() {
    local status=$?
    [ "$BASHPID" = "$$" ] || exit "$status"
    die "stopped at line $1: \"${2//$'\n'/ }\" failed (exit $status)${LOG:+; see $LOG}"
}
# The Debian mirror apt uses on the machine whose root file system is at $1 ("" for this one): the first URI
# ending in /debian of a deb822 "URIs:" line (sources.list.d/*.sources) or a one-line "deb" entry (sources.list,
# sources.list.d/*.list). Either form may be missing; prints nothing when none names such a mirror.
debian_mirror() {
    local file files=()
    for file in "$1"/etc/apt/sources.list.d/*.sources "$1"/etc/apt/sources.list "$1"/etc/apt/sources.list.d/*.list; do
        [ -f "$file" ] && files+=("$file")
    done
    [ "${#files[@]}" -gt 0 ] || return 0
    sed -n -e '/^URIs:[[:space:]]*\([^[:space:]]*\/debian\)\/\{0,1\}\([[:space:]].*\)\{0,1\}$/{s//\1/p;q}' \
        -e '/^deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]*\)\{0,1\}\([^[:space:]]*\/debian\)\/\{0,1\}[[:space:]].*/{s//\2/p;q}' \
        "${files[@]}"
}
running() {
    local state
    state=$(ps -o stat= -p "$1") && [ "${state:0:1}" != Z ]
}
# Wait until READY exists: the --ready-file of the edgefl command WHAT running as PID, its output in OUTPUT. Fails
# in one line (after OUTPUT's last lines when it exited) if the process ends first or after TIMEOUT s (default
# STARTUP_TIMEOUT_S).
wait_ready() {
    local ready=$1 pid=$2 what=$3 output=$4 timeout=${5:-$STARTUP_TIMEOUT_S}
    local deadline=$((SECONDS + timeout))
    until [ -e "$ready" ]; do
        if ! running "$pid" && [ ! -e "$ready" ]; then # the file is looked at again: it may have come just before
            tail -n 5 "$output" >&2
            die "$what exited before it wrote $ready; see $output"
        fi
        [ "$SECONDS" -lt "$deadline" ] || die "$what was not ready within $timeout s (no $ready); see $output"
        sleep 0.5
    done
}
# Sourced (the tests): the functions above only.
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0
trap 'on_error "$LINENO" "$BASH_COMMAND"' ERR
while [ $# -gt 0 ]; do
    case "$1" in
        --cache) CACHE=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --local-steps) LOCAL_STEPS=$2; shift 2 ;;
        --fresh-venv) FRESH_VENV=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[ "$(id -u)" -eq 0 ] || die "needs root (chroot, mounts, binfmt_misc)"
mkdir -p "$CACHE" "$OUT"
CACHE=$(cd "$CACHE" && pwd)
OUT=$(cd "$OUT" && pwd)
ROOTFS=$CACHE/rootfs
MIRROR=$(debian_mirror "") # debootstrap's own default when there is none
LOG=$OUT/aarch64_check.log
: >"$LOG"
EDGEFL=edgefl
[ -x "$REPO/.venv/bin/edgefl" ] && EDGEFL=$REPO/.venv/bin/edgefl
# A command inside the root file system: a clean environment, and this machine's CA bundle for pip (so that a
# TLS-inspecting proxy, like this sandbox's, is trusted there too).
CHROOT=(chroot "$ROOTFS" env -i "PATH=$DEVICE_PROJECT/.venv/bin:/usr/sbin:/usr/bin:/sbin:/bin" HOME=/root
    DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_CERT=/etc/edgefl-host-ca.crt)

MOUNTED_BINFMT=0
ENABLED_QEMU=0
PIDS=() # what runs in the background, stopped in reverse order on exit

# Every mount below $CACHE (ours and any that a killed debootstrap left), deepest first.
unmount_cache() {
    local target
    awk -v root="$CACHE/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r | while read -r target; do
        umount "$target" || umount -l "$target"
    done
}

# PIDs of the processes running inside the root file system (installer, agent, SuperNode, its ClientApps).
chroot_pids() {
    local proc
    for proc in /proc/[0-9]*; do
        [ "$(readlink "$proc/root" 2>/dev/null)" = "$ROOTFS" ] && echo "${proc#/proc/}"
    done
    return 0
}

stop_chroot_processes() {
    local pids tries=50
    mapfile -t pids < <(chroot_pids)
    [ "${#pids[@]}" -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null
    while [ -n "$(chroot_pids)" ] && [ $((tries -= 1)) -gt 0 ]; do sleep 0.1; done
    mapfile -t pids < <(chroot_pids)
    [ "${#pids[@]}" -eq 0 ] || kill -KILL "${pids[@]}" 2>/dev/null
}

cleanup() {
    trap - ERR
    set +e
    local i
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        kill -TERM "${PIDS[i]}" 2>/dev/null && wait "${PIDS[i]}"
    done
    stop_chroot_processes
    unmount_cache
    [ "$ENABLED_QEMU" -eq 1 ] && update-binfmts --disable qemu-aarch64 >>"$LOG" 2>&1
    [ "$MOUNTED_BINFMT" -eq 1 ] && umount /proc/sys/fs/binfmt_misc
    return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { echo "== $*" | tee -a "$LOG"; }

# The working tree into the root file system (again before the run: the editable install then runs it).
copy_project() {
    mkdir -p "$ROOTFS$DEVICE_PROJECT"
    tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./runs --exclude='*.egg-info' \
        --exclude=__pycache__ -cf - . | tar -C "$ROOTFS$DEVICE_PROJECT" -xf -
}

step "qemu-user-static, binfmt-support and debootstrap on this machine"
export DEBIAN_FRONTEND=noninteractive
nice -n 19 apt-get update -qq >>"$LOG" 2>&1
nice -n 19 apt-get install -y -qq qemu-user-static binfmt-support debootstrap >>"$LOG" 2>&1

step "qemu-aarch64 in binfmt_misc"
if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc || die "cannot mount binfmt_misc"
    MOUNTED_BINFMT=1
fi
if ! grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null; then
    update-binfmts --enable qemu-aarch64 >>"$LOG" 2>&1 || die "update-binfmts --enable qemu-aarch64 failed; see $LOG"
    ENABLED_QEMU=1
fi
# F (fix binary): the kernel keeps the interpreter open, so the chroot needs no copy of it.
grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || die "qemu-aarch64 is registered without the F flag"

if [ ! -d "$ROOTFS" ]; then
    step "debootstrap bookworm arm64 into $ROOTFS (once; cached)"
    rm -rf --one-file-system "$ROOTFS.partial"
    start=$SECONDS
    nice -n 19 debootstrap --arch=arm64 --variant=minbase bookworm "$ROOTFS.partial" ${MIRROR:+"$MIRROR"} >>"$LOG" 2>&1 ||
        die "debootstrap failed; see $LOG"
    mv "$ROOTFS.partial" "$ROOTFS"
    echo "debootstrap: $((SECONDS - start)) s" | tee -a "$LOG"
fi

step "mounts and network settings for the chroot"
mount -t proc proc "$ROOTFS/proc"
mount -t sysfs sysfs "$ROOTFS/sys"
mount --rbind /dev "$ROOTFS/dev"
mount --make-rslave "$ROOTFS/dev"
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
cp "$HOST_CA" "$ROOTFS/etc/edgefl-host-ca.crt"

step "the project's installer (install.sh) inside the chroot"
[ "$FRESH_VENV" -eq 1 ] && rm -rf --one-file-system "$ROOTFS$DEVICE_PROJECT"
venv=new
[ -x "$ROOTFS$DEVICE_PROJECT/.venv/bin/python" ] && venv="kept from an earlier run"
pip_cache=cold
[ -d "$ROOTFS/root/.cache/pip" ] && pip_cache=warm
copy_project
start=$SECONDS
if ! "${CHROOT[@]}" nice -n 19 "$DEVICE_PROJECT/install.sh" >>"$LOG" 2>&1; then
    tail -n 15 "$LOG" >&2
    die "install.sh failed inside the chroot; see $LOG"
fi
install_s=$((SECONDS - start))
arch=$("${CHROOT[@]}" uname -m)
versions=$("${CHROOT[@]}" python -c '
import platform
from importlib.metadata import version
packages = ", ".join(f"{name} {version(name)}" for name in ("torch", "flwr", "onnxruntime"))
print(f"python {platform.python_version()}, {packages}")
')
echo "install: $install_s s (.venv $venv, pip cache $pip_cache); $arch; $versions" | tee -a "$LOG"

step "edgefl server here, edgefl client in the chroot, edgefl run --federation remote (TLS)"
copy_project
start=$SECONDS
"${CHROOT[@]}" nice -n 19 python -c '
import sys
from edgefl.cli import build_parser, config_from_args
from ml.data import load_dataset, one_partition

config = config_from_args(build_parser().parse_args(["run", *sys.argv[1:]]))
dataset = load_dataset(config.dataset, config.data_dir or None)
one_partition(dataset, config.partition_spec, config.clients, config.seed, 0)  # edgefl client --partition-id 0
' "${RUN_DATA[@]}" >>"$LOG" 2>&1
echo "the client's split of the data, made in the chroot: $((SECONDS - start)) s" | tee -a "$LOG"
rm -rf "$OUT/certs"
"$EDGEFL" certs --out "$OUT/certs" --host 127.0.0.1 --submitters 1 >>"$LOG"
cp "$OUT/certs/ca.pem" "$ROOTFS/root/edgefl-ca.pem"
server=127.0.0.1:$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rm -f "$OUT/server.ready" "$ROOTFS$DEVICE_OUT.ready" # an earlier run's (each command removes its own too)
nice -n 19 "$EDGEFL" server --listen "$server" --certs "$OUT/certs" --out "$OUT/server" --allow-any-device \
    --ready-file "$OUT/server.ready" >"$OUT/server.out" 2>&1 &
PIDS+=($!)
wait_ready "$OUT/server.ready" "$!" "edgefl server" "$OUT/server.out"
"${CHROOT[@]}" nice -n 19 edgefl client --server "$server" --root-cert /root/edgefl-ca.pem --partition-id 0 \
    --num-partitions 1 --dataset digits --out "$DEVICE_OUT" --connect-timeout "$STARTUP_TIMEOUT_S" \
    --startup-timeout "$STARTUP_TIMEOUT_S" --ready-file "$DEVICE_OUT.ready" >"$OUT/client.out" 2>&1 &
PIDS+=($!)
wait_ready "$ROOTFS$DEVICE_OUT.ready" "$!" "edgefl client" "$OUT/client.out"
start=$SECONDS
nice -n 19 "$EDGEFL" run --federation remote --server "$server" --root-cert "$OUT/certs/ca.pem" --submitter-cert "$OUT/certs/submitter-0.pem" --strategy fedavg \
    "${RUN_DATA[@]}" --rounds "$ROUNDS" --local-steps "$LOCAL_STEPS" \
    --round-deadline-s 600 --out "$OUT/run" > >(tee -a "$LOG") 2>&1 &
PIDS+=($!)
run_status=0
wait "$!" || run_status=$?
unset 'PIDS[-1]'
run_s=$((SECONDS - start))

# Every round in rounds.jsonl, each closed with client 0's update; prints round 1's wall-clock seconds and the
# highest peak RSS the agent reported (client_health; under qemu-user, the emulator's memory is in it too).
first_round=$(python3 - "$OUT/run/rounds.jsonl" "$ROUNDS" 2>&1 <<'EOF'
import json, math, sys
path, rounds = sys.argv[1], int(sys.argv[2])
rows = [json.loads(line) for line in open(path)]
if len(rows) != rounds:
    sys.exit(f"{len(rows)} of {rounds} rounds in {path}")
for row in rows:
    if row["clients"] != [0] or row["bytes_up"] <= 0 or not math.isfinite(row["train_loss"]):
        sys.exit(f"round {row['round']} has no update from client 0")
peak = max((row["client_health"].get("0") or {}).get("peak_rss_mb") or 0.0 for row in rows)
print(f"{rows[0]['wall_s']:.1f} s (client's local training {rows[0]['client_train_s']:.1f} s); "
      f"the agent's peak RSS {peak:.0f} MB")
EOF
) || {
    echo "aarch64_check: $first_round" | tee -a "$LOG"
    first_round=none
    run_status=1
}

verdict=FAIL
[ "$run_status" -eq 0 ] && [ "$arch" = aarch64 ] && verdict=PASS
{
    echo
    echo "aarch64 check: $verdict"
    echo "  client architecture (uname -m in the chroot): $arch"
    echo "  installed in the chroot: $versions"
    echo "  install.sh in the chroot: $install_s s (Debian bookworm arm64 under qemu-aarch64; .venv $venv," \
        "pip cache $pip_cache)"
    echo "  first round: $first_round; $ROUNDS rounds of $LOCAL_STEPS local steps (digits, 1 client): $run_s s"
    echo "  log: $LOG (and server.out, client.out beside it)"
    echo "  run: $OUT/run (server: $OUT/server/logs, client: $ROOTFS$DEVICE_OUT/logs)"
} | tee -a "$LOG"
[ "$verdict" = PASS ] || exit 1
