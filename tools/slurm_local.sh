#!/usr/bin/env bash
# A real single-node Slurm cluster with accounting on this machine, for CI and local development.
#
#   tools/slurm_local.sh start    install Slurm/munge/slurmdbd/MariaDB from Debian if missing, then start
#                                 munged -> mariadbd -> slurmdbd -> slurmctld -> slurmd and wait for `idle`
#   tools/slurm_local.sh stop     stop the daemons started by `start`, in reverse order (by pid file)
#   tools/slurm_local.sh status   say whether the cluster answers; print the SLURM_CONF to export
#
# All state (configs, pid files, logs, the accounting database, spool) lives in one run directory,
# $SRPO_SLURM_DIR (default /tmp/srpo-slurm); nothing is written to /etc/slurm. Clients find the cluster
# through `export SLURM_CONF=$SRPO_SLURM_DIR/slurm.conf` (printed by start/status). Accounting is
# required: nemo-run reads job state only through `sacct`. Every command is idempotent; a failure exits
# non-zero after printing the tail of the relevant logs. Must run as root (CI does).
set -euo pipefail

R="${SRPO_SLURM_DIR:-/tmp/srpo-slurm}"
DB_PORT="${SRPO_SLURM_DB_PORT:-3306}"
CLUSTER=ci
export SLURM_CONF="$R/slurm.conf"

log() { echo "[slurm_local] $*" >&2; }

die() {
  log "ERROR: $*"
  for f in "$R"/log/slurm*.log "$R/mysql/mysqld.err" "$R/munge/munged.log" "$R/log/apt.log"; do
    [[ -f "$f" ]] || continue
    echo "----- tail of $f -----" >&2
    tail -n 25 "$f" >&2 || true
  done
  exit 1
}

alive() { # alive PIDFILE: the process named in PIDFILE is running
  [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

wait_for() { # wait_for SECONDS DESCRIPTION CMD...: poll CMD every 0.2 s
  local secs="$1" what="$2"
  shift 2
  local i
  for ((i = 0; i < secs * 5; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  die "$what did not come up within ${secs}s"
}

install_if_missing() {
  local need=()
  command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || need+=(slurm-wlm munge)
  local dbd=()
  command -v slurmdbd >/dev/null 2>&1 || dbd+=(slurmdbd)
  command -v mariadbd >/dev/null 2>&1 || dbd+=(mariadb-server)
  if ((${#need[@]} + ${#dbd[@]} == 0)); then return 0; fi
  [[ $(id -u) == 0 ]] || die "Slurm is not installed and installing it needs root: apt-get install slurm-wlm munge slurmdbd mariadb-server"
  log "installing ${need[*]} ${dbd[*]} from Debian"
  mkdir -p "$R/log"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >"$R/log/apt.log" 2>&1 || die "apt-get update failed (see $R/log/apt.log)"
  if ((${#need[@]})); then
    apt-get install -y -qq "${need[@]}" >>"$R/log/apt.log" 2>&1 || die "apt-get install ${need[*]} failed"
  fi
  if ((${#dbd[@]})); then
    apt-get install -y -qq --no-install-recommends "${dbd[@]}" >>"$R/log/apt.log" 2>&1 ||
      die "apt-get install ${dbd[*]} failed"
  fi
}

write_configs() {
  local mem_mib
  # Leave 1 GiB to the OS so slurmd does not drain the node for "Low RealMemory".
  mem_mib=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
  local cpus
  cpus=$(nproc)
  mkdir -p "$R"/{state,spool,log,munge,mysql/data}
  cat >"$R/slurm.conf" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$R/state
SlurmdSpoolDir=$R/spool
SlurmctldPidFile=$R/slurmctld.pid
SlurmdPidFile=$R/slurmd.pid
SlurmctldLogFile=$R/log/slurmctld.log
SlurmdLogFile=$R/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/filetxt
JobCompLoc=$R/log/jobcomp.txt
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=300
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  (
    umask 077
    cat >"$R/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$R/slurmdbd.pid
LogFile=$R/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$R/slurmdbd.conf"
}

# Slurm's clients (sacctmgr in 22.05) ignore AuthInfo=socket=..., so munged serves the default socket
# /run/munge/munge.socket.2; its pid, log and seed files still live in the run directory.
munge_ok() { munge -n | unmunge; }

start_munge() {
  if munge_ok >/dev/null 2>&1; then return 0; fi
  [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing; reinstall munge (apt-get install --reinstall munge)"
  # munged refuses directories that others can write to: both are owned by munge.
  mkdir -p /run/munge
  chown munge:munge /run/munge "$R/munge"
  chmod 755 /run/munge "$R/munge"
  runuser -u munge -- munged --pid-file="$R/munge/munged.pid" --log-file="$R/munge/munged.log" \
    --seed-file="$R/munge/munged.seed" || die "munged did not start (see $R/munge/munged.log)"
  wait_for 10 munged munge_ok
}

db() { mariadb --socket="$R/mysql/mysqld.sock" -u root "$@"; }

start_mariadb() {
  if alive "$R/mysql/mysqld.pid"; then return 0; fi
  # mariadbd exits silently unless every path it writes lies in a directory owned by mysql.
  chown -R mysql:mysql "$R/mysql"
  if [[ ! -d "$R/mysql/data/mysql" ]]; then
    mariadb-install-db --user=mysql --datadir="$R/mysql/data" --skip-test-db \
      >"$R/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (see $R/log/mariadb-install.log)"
  fi
  # setsid + nohup: the database must outlive this script (it is a daemon here, like the others).
  setsid nohup mariadbd --user=mysql --datadir="$R/mysql/data" --socket="$R/mysql/mysqld.sock" \
    --pid-file="$R/mysql/mysqld.pid" --log-error="$R/mysql/mysqld.err" --port="$DB_PORT" \
    --bind-address=127.0.0.1 >/dev/null 2>&1 </dev/null &
  wait_for 30 mariadbd db -e "SELECT 1"
  db -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
         CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
         GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
         GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
    die "could not create the accounting database user"
}

start_slurmdbd() {
  if ! alive "$R/slurmdbd.pid"; then
    slurmdbd || die "slurmdbd did not start"
  fi
  wait_for 30 slurmdbd timeout 5 sacctmgr -n show cluster
  if ! timeout 10 sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
    timeout 10 sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed"
  fi
}

node_idle() { timeout 5 sinfo -h -N -o %T | grep -Eq '^(idle|mixed|allocated)'; }

start() {
  [[ $(id -u) == 0 ]] || die "start must run as root (the daemons run as root/munge/mysql)"
  install_if_missing
  write_configs
  start_munge
  start_mariadb
  start_slurmdbd
  alive "$R/slurmctld.pid" || slurmctld || die "slurmctld did not start"
  alive "$R/slurmd.pid" || slurmd -N localhost || die "slurmd did not start"
  wait_for 60 "the node (sinfo state idle)" node_idle
  log "cluster '$CLUSTER' is up"
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pid() { # stop_pid NAME PIDFILE
  local pidfile="$2" i
  alive "$pidfile" || return 0
  local pid
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  log "$1 (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
  kill -9 "$pid" 2>/dev/null || true
}

stop() {
  stop_pid slurmd "$R/slurmd.pid"
  stop_pid slurmctld "$R/slurmctld.pid"
  stop_pid slurmdbd "$R/slurmdbd.pid"
  stop_pid mariadbd "$R/mysql/mysqld.pid"
  stop_pid munged "$R/munge/munged.pid"
  log "stopped"
}

status() {
  if [[ -f "$SLURM_CONF" ]] && node_idle; then
    sinfo >&2
    echo "export SLURM_CONF=$SLURM_CONF"
  else
    die "the cluster in $R is not answering (run: tools/slurm_local.sh start)"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *)
    echo "usage: $0 start|stop|status   (run directory: \$SRPO_SLURM_DIR, default /tmp/srpo-slurm)" >&2
    exit 2
    ;;
esac
