# Shared settings for the local Kafka and Redis scripts. Sourced, not run.
# Every value can be overridden from the environment (the Makefile passes them).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KAFKA_VERSION=${KAFKA_VERSION:-$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$ROOT/compose/local/kafka-pom.xml")}
KAFKA_HOST=127.0.0.1
KAFKA_PORT=${KAFKA_PORT:-9092}
KAFKA_CONTROLLER_PORT=${KAFKA_CONTROLLER_PORT:-$((KAFKA_PORT + 1))}
KAFKA_HEAP=${KAFKA_HEAP:-"-Xms256m -Xmx1g"}
# The broker's garbage collector and its options (JVM flags).
KAFKA_GC=${KAFKA_GC:-"-XX:+UseG1GC -XX:MaxGCPauseMillis=20"}
REDIS_HOST=127.0.0.1
REDIS_PORT=${REDIS_PORT:-6379}
# SeaweedFS's S3 gateway, the S3-compatible object store of the tests (Apache-2.0),
# built from its Go module; the other ports follow S3_PORT as in SeaweedFS's defaults
# (S3 8333: filer 8888, master 9333, volume 8080; gRPC on each port + 10000).
SEAWEEDFS_VERSION=${SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}
S3_HOST=127.0.0.1
S3_PORT=${S3_PORT:-8333}
SEAWEEDFS_FILER_PORT=${SEAWEEDFS_FILER_PORT:-$((S3_PORT + 555))}
SEAWEEDFS_MASTER_PORT=${SEAWEEDFS_MASTER_PORT:-$((S3_PORT + 1000))}
SEAWEEDFS_VOLUME_PORT=${SEAWEEDFS_VOLUME_PORT:-$((S3_PORT - 253))}
# Credentials of the local store only (tests and the demo); never a real secret.
S3_ACCESS_KEY=${S3_ACCESS_KEY:-conveyor-local}
S3_SECRET_KEY=${S3_SECRET_KEY:-conveyor-local-secret}
CACHE_DIR=${CONVEYOR_CACHE_DIR:-$ROOT/.cache}
RUN_DIR=${CONVEYOR_RUN_DIR:-$ROOT/.run}
KAFKA_LIBS=$CACHE_DIR/kafka-$KAFKA_VERSION/libs
KAFKA_DIR=$RUN_DIR/kafka-$KAFKA_PORT
REDIS_DIR=$RUN_DIR/redis-$REDIS_PORT
WEED_BIN=$CACHE_DIR/seaweedfs-$SEAWEEDFS_VERSION/weed
SEAWEEDFS_DIR=$RUN_DIR/seaweedfs-$S3_PORT
READY_TIMEOUT=${READY_TIMEOUT:-90}

log() { printf '[conveyor] %s\n' "$*" >&2; }
die() { printf '[conveyor] ERROR: %s\n' "$*" >&2; exit 1; }

# Broker settings of every local broker: topics created explicitly (a typo in a
# model name is an error, not a new topic), fast group joins for tests, and room
# for the contract's largest payload (16 MiB) plus headers.
kafka_common_config() {
  cat <<CFG
num.partitions=3
auto.create.topics.enable=false
group.initial.rebalance.delay.ms=0
group.consumer.min.session.timeout.ms=1000
group.classic.min.session.timeout.ms=1000
message.max.bytes=20971520
CFG
}

# kafka.sh and secure.sh: one node, so every internal topic has a single replica.
kafka_single_node_config() {
  kafka_common_config
  cat <<CFG
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
CFG
}

# pid_alive PIDFILE PATTERN: true when the pid file names a live process whose
# command line contains PATTERN (so a recycled pid is never mistaken for ours).
pid_alive() {
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1")
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2"
}

# apt_install COMMAND PACKAGE: install a Debian package when COMMAND is not on PATH.
apt_install() {
  command -v "$1" >/dev/null && return 0
  log "$1 is not on PATH; installing Debian's $2 package"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  # RUNLEVEL=1 keeps a package's own init script from starting a system service.
  { $sudo apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$2"; } >/dev/null \
    || die "could not install $2 with apt-get; install it yourself so that $1 is on PATH"
}

# running PID: alive and not a zombie (a container's init may never reap it).
running() {
  local state
  state=$(sed -n 's/^[0-9]* (.*) \([A-Z]\).*/\1/p' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# stop_pid PIDFILE PATTERN NAME [GRACE_S]: SIGTERM, wait up to GRACE_S (30), then
# SIGKILL; removes the pid file.
stop_pid() {
  local pidfile=$1 pattern=$2 name=$3 grace=${4:-30} pid i
  if ! pid_alive "$pidfile" "$pattern"; then
    rm -f "$pidfile"
    return 0
  fi
  pid=$(cat "$pidfile")
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 $((grace * 10))); do
    running "$pid" || break
    sleep 0.1
  done
  if running "$pid"; then
    log "$name did not stop within $grace s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
      running "$pid" || break
      sleep 0.1
    done
  fi
  rm -f "$pidfile"
}

# fail_start NAME PORT LOGFILE: the one-paragraph error for a service that did not come up.
fail_start() {
  {
    printf '[conveyor] ERROR: %s did not become ready on 127.0.0.1:%s within %s s.\n' "$1" "$2" "$READY_TIMEOUT"
    printf 'Is another process using port %s? Choose another with %s=<port>. Log file: %s\n' "$2" "$4" "$3"
    # A broker's cause (a port taken, a bad setting) sits above its shutdown lines.
    if grep -qE '^\[[^]]*\] (ERROR|FATAL) ' "$3" 2>/dev/null; then
      printf -- '--- errors in %s ---\n' "$3"
      grep -E '^\[[^]]*\] (ERROR|FATAL) ' "$3" | tail -n 5 | cut -c1-400
    fi
    printf -- '--- last lines of %s ---\n' "$3"
    tail -n 25 "$3" 2>/dev/null || true
  } >&2
  exit 1
}

# kafka_random_id: a new cluster id, from Kafka's own StorageTool.
kafka_random_id() {
  java -cp "$KAFKA_LIBS/*" kafka.tools.StorageTool random-uuid 2>/dev/null \
    || die "Kafka's StorageTool failed (java: $(command -v java)); run it by hand: java -cp '$KAFKA_LIBS/*' kafka.tools.StorageTool random-uuid"
}

# kafka_format CONFIG CLUSTER_ID LOG_DIR [STORAGE TOOL ARGS...]: format the storage named
# in CONFIG for the cluster CLUSTER_ID (once: callers check meta.properties first).
kafka_format() {
  local config=$1 cluster_id=$2 logs=$3
  shift 3
  java -cp "$KAFKA_LIBS/*" -Dlog4j2.configurationFile="$ROOT/compose/local/log4j2.properties" \
    -Dkafka.logs.dir="$logs" \
    kafka.tools.StorageTool format -t "$cluster_id" -c "$config" "$@" >"$logs/format.log" 2>&1 \
    || { tail -n 20 "$logs/format.log" >&2; die "formatting Kafka storage for $config failed (log: $logs/format.log)"; }
}

# kafka_launch CONFIG LOG_DIR PIDFILE HEAP: start a broker in the background; its pid goes to PIDFILE.
kafka_launch() {
  # shellcheck disable=SC2086
  nohup java $4 $KAFKA_GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$ROOT/compose/local/log4j2.properties" \
    -Dkafka.logs.dir="$2" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$1" >"$2/stdout.log" 2>&1 </dev/null &
  echo $! >"$3"
}
