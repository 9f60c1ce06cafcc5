#!/usr/bin/env bash
# Start or stop a 3-broker KRaft Kafka cluster on 127.0.0.1, beside the single broker
# of kafka.sh (other ports, another run folder), for replication and failover tests.
#
# Each node is broker and controller at once (combined mode): three JVMs instead of
# six, and a quorum of three voters that survives the loss of any one node. Node n
# (1..3) serves clients on KAFKA_CLUSTER_PORT+n-1 (default 9292..9294) and votes on
# KAFKA_CLUSTER_CONTROLLER_PORT+n-1 (default KAFKA_CLUSTER_PORT+3..+5). Topics get
# three replicas and need two in sync to accept a write (acks=all), as
# docs/operations.md asks of a production cluster.
#
# Usage: kafka-cluster.sh start|stop|status [NODE]    (NODE 1..3; default: every node)
# start waits until every node it started is registered and unfenced; stop sends
# SIGTERM (a controlled shutdown that hands leadership over first), then waits.
set -euo pipefail
source "$(dirname "$0")/env.sh"

NODES=3
KAFKA_CLUSTER_PORT=${KAFKA_CLUSTER_PORT:-9292}
KAFKA_CLUSTER_CONTROLLER_PORT=${KAFKA_CLUSTER_CONTROLLER_PORT:-$((KAFKA_CLUSTER_PORT + NODES))}
# Three JVMs on one small machine: a small heap each is plenty for tests.
KAFKA_CLUSTER_HEAP=${KAFKA_CLUSTER_HEAP:-"-Xms128m -Xmx512m"}
CLUSTER_DIR=$RUN_DIR/kafka-cluster-$KAFKA_CLUSTER_PORT

port_of() { echo $((KAFKA_CLUSTER_PORT + $1 - 1)); }
controller_port_of() { echo $((KAFKA_CLUSTER_CONTROLLER_PORT + $1 - 1)); }
node_dir() { echo "$CLUSTER_DIR/node-$1"; }
config_of() { echo "$(node_dir "$1")/server.properties"; }
pidfile_of() { echo "$(node_dir "$1")/kafka.pid"; }
logfile_of() { echo "$(node_dir "$1")/logs/server.log"; }
pattern_of() { echo "kafka.Kafka $(config_of "$1")"; }

voters() {
  local n out=""
  for n in $(seq 1 $NODES); do
    out+="${out:+,}$n@$KAFKA_HOST:$(controller_port_of "$n")"
  done
  echo "$out"
}

write_config() {
  local n=$1 dir
  dir=$(node_dir "$n")
  mkdir -p "$dir/data" "$dir/logs"
  cat >"$(config_of "$n")" <<CFG
# Written by compose/local/kafka-cluster.sh; edits are overwritten on the next start.
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$(voters)
listeners=PLAINTEXT://$KAFKA_HOST:$(port_of "$n"),CONTROLLER://$KAFKA_HOST:$(controller_port_of "$n")
advertised.listeners=PLAINTEXT://$KAFKA_HOST:$(port_of "$n")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$dir/data
$(kafka_common_config)
# Replication, as in production: every topic (internal ones included) on three
# brokers, a write acknowledged (acks=all) only once two replicas have it, and
# never a leader elected from outside the in-sync replicas.
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false
offsets.topic.replication.factor=3
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
# A crashed broker is fenced (its partitions get new leaders) within 3 s instead of 9 s.
broker.heartbeat.interval.ms=500
broker.session.timeout.ms=3000
# Small thread pools: three brokers share a small machine.
num.network.threads=2
num.io.threads=2
background.threads=2
log.retention.hours=24
log.segment.bytes=104857600
CFG
}

# Nodes named on the command line, or all of them.
selected() {
  if [ -n "${1:-}" ]; then
    [[ "$1" =~ ^[1-3]$ ]] || die "no node $1: the cluster has nodes 1, 2 and 3"
    echo "$1"
  else
    seq 1 $NODES
  fi
}

start() {
  local n started=() port
  for n in $(selected "${1:-}"); do
    if pid_alive "$(pidfile_of "$n")" "$(pattern_of "$n")"; then
      log "Kafka cluster node $n already running (pid $(cat "$(pidfile_of "$n")")) on $KAFKA_HOST:$(port_of "$n")"
      continue
    fi
    for port in "$(port_of "$n")" "$(controller_port_of "$n")"; do
      if port_in_use "$port"; then
        die "cannot start Kafka cluster node $n: port $port on 127.0.0.1 is already in use by another process. Stop it, or choose free ports with KAFKA_CLUSTER_PORT=<port> (nodes use it and the next 5). Log file: $(logfile_of "$n")"
      fi
    done
    started+=("$n")
  done
  [ ${#started[@]} -gt 0 ] || return 0
  "$ROOT/compose/local/fetch-kafka.sh"
  mkdir -p "$CLUSTER_DIR"
  if [ ! -f "$CLUSTER_DIR/cluster.id" ]; then
    kafka_random_id >"$CLUSTER_DIR/cluster.id.new"
    mv "$CLUSTER_DIR/cluster.id.new" "$CLUSTER_DIR/cluster.id"
  fi
  for n in "${started[@]}"; do
    write_config "$n"
    if [ ! -f "$(node_dir "$n")/data/meta.properties" ]; then
      kafka_format "$(config_of "$n")" "$(cat "$CLUSTER_DIR/cluster.id")" "$(node_dir "$n")/logs"
    fi
    log "starting Kafka cluster node $n on $KAFKA_HOST:$(port_of "$n") (log: $(logfile_of "$n"))"
    kafka_launch "$(config_of "$n")" "$(node_dir "$n")/logs" "$(pidfile_of "$n")" "$KAFKA_CLUSTER_HEAP"
  done
  # All started first, then waited for: a lone node cannot elect a controller.
  for n in "${started[@]}"; do
    if ! python3 "$ROOT/compose/local/ready.py" kafka "$KAFKA_HOST" "$(port_of "$n")" \
        --brokers $NODES --timeout "$READY_TIMEOUT" --pid "$(cat "$(pidfile_of "$n")")"; then
      cat "$(node_dir "$n")/logs/stdout.log" >>"$(logfile_of "$n")" 2>/dev/null || true
      stop "${1:-}"
      fail_start "Kafka cluster node $n" "$(port_of "$n")" "$(logfile_of "$n")" KAFKA_CLUSTER_PORT
    fi
  done
  log "Kafka cluster ready: bootstrap $(bootstrap)"
}

stop() {
  local n pid
  # Signal every node first, so they shut down together rather than one after
  # another waiting for a quorum that is leaving too.
  for n in $(selected "${1:-}"); do
    if pid_alive "$(pidfile_of "$n")" "$(pattern_of "$n")"; then
      pid=$(cat "$(pidfile_of "$n")")
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  for n in $(selected "${1:-}"); do
    stop_pid "$(pidfile_of "$n")" "$(pattern_of "$n")" "Kafka cluster node $n"
  done
}

status() {
  local n down=0
  for n in $(selected "${1:-}"); do
    if pid_alive "$(pidfile_of "$n")" "$(pattern_of "$n")"; then
      echo "kafka cluster node $n running pid $(cat "$(pidfile_of "$n")") port $(port_of "$n")"
    else
      echo "kafka cluster node $n stopped"
      down=1
    fi
  done
  return $down
}

bootstrap() {
  local n out=""
  for n in $(seq 1 $NODES); do
    out+="${out:+,}$KAFKA_HOST:$(port_of "$n")"
  done
  echo "$out"
}

case "${1:-}" in
  start) start "${2:-}" ;;
  stop) stop "${2:-}" ;;
  status) status "${2:-}" ;;
  bootstrap) bootstrap ;;
  *) die "usage: kafka-cluster.sh start|stop|status [NODE] | bootstrap" ;;
esac
