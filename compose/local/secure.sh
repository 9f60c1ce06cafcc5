#!/usr/bin/env bash
# Start or stop a secured Kafka broker and Redis server on 127.0.0.1, beside the
# plain ones (other ports, other run folders), to try and test authenticated,
# encrypted connections:
#   Kafka  SASL_SSL with SCRAM-SHA-512 on SECURE_KAFKA_PORT (default 9192)
#   Redis  TLS only, ACL user and no default user, on SECURE_REDIS_PORT (default 6380)
# Both accept the user SECURE_USER (default conveyor) with SECURE_PASSWORD (required).
# A throw-away CA and server certificate (SAN 127.0.0.1 and localhost) are made at the
# first start in the run folder; clients trust it through its ca.pem.
# With SECURE_ACLS=1 the broker authorizes every request (KRaft's StandardAuthorizer):
# SECURE_USER is a super user, and a second SCRAM user, SECURE_LIMITED_USER (default
# conveyor-limited, same password), may do only what ACLs grant it, none at first
# (grant them with compose/local/kafka-acls.sh; docs/security.md lists a worker's).
# Usage: SECURE_PASSWORD=... [SECURE_ACLS=1] secure.sh start|stop|status
set -euo pipefail
source "$(dirname "$0")/env.sh"

SECURE_KAFKA_PORT=${SECURE_KAFKA_PORT:-9192}
# The controller and the broker's own (inter-broker) listener stay PLAINTEXT, on
# loopback only: no client is told about them, and they spare this single node
# a SASL client configuration of its own.
SECURE_CONTROLLER_PORT=${SECURE_CONTROLLER_PORT:-$((SECURE_KAFKA_PORT + 1))}
SECURE_INTERNAL_PORT=${SECURE_INTERNAL_PORT:-$((SECURE_KAFKA_PORT + 2))}
SECURE_REDIS_PORT=${SECURE_REDIS_PORT:-6380}
SECURE_USER=${SECURE_USER:-conveyor}
SECURE_ACLS=${SECURE_ACLS:-0}
SECURE_LIMITED_USER=${SECURE_LIMITED_USER:-conveyor-limited}
# Users are written when storage is formatted: a broker with ACLs keeps a folder of its own.
ACL_SUFFIX=""
ACL_NOTE=""
if [ "$SECURE_ACLS" = 1 ]; then
  ACL_SUFFIX=-acl
  ACL_NOTE=", ACLs"
fi
DIR=$RUN_DIR/secure-$SECURE_KAFKA_PORT-$SECURE_REDIS_PORT$ACL_SUFFIX
TLS=$DIR/tls
KAFKA_CONFIG=$DIR/kafka/server.properties
KAFKA_PIDFILE=$DIR/kafka/kafka.pid
KAFKA_LOG=$DIR/kafka/logs/server.log
KAFKA_PATTERN="kafka.Kafka $KAFKA_CONFIG"
REDIS_PIDFILE=$DIR/redis/redis.pid
REDIS_LOG=$DIR/redis/redis.log
REDIS_PATTERN="redis-server $REDIS_HOST:$SECURE_REDIS_PORT"

make_certificates() {
  [ -f "$TLS/server.p12" ] && return 0
  apt_install openssl openssl  # it makes the local CA
  mkdir -p "$TLS"
  chmod 700 "$TLS"
  log "making a local CA and a server certificate in $TLS"
  {
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=conveyor local CA" \
      -keyout "$TLS/ca.key" -out "$TLS/ca.pem"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
      -keyout "$TLS/server.key" -out "$TLS/server.csr"
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$TLS/san.ext"
    openssl x509 -req -days 30 -in "$TLS/server.csr" -CA "$TLS/ca.pem" -CAkey "$TLS/ca.key" \
      -CAcreateserial -extfile "$TLS/san.ext" -out "$TLS/server.pem"
    # The broker reads a PKCS12 keystore; its password only guards the local file.
    openssl pkcs12 -export -in "$TLS/server.pem" -inkey "$TLS/server.key" -certfile "$TLS/ca.pem" \
      -name broker -passout pass:conveyor-keystore -out "$TLS/server.p12"
  } >"$TLS/openssl.log" 2>&1 || die "openssl failed making certificates (log: $TLS/openssl.log)"
}

write_kafka_config() {
  mkdir -p "$DIR/kafka/data" "$DIR/kafka/logs"
  cat >"$KAFKA_CONFIG" <<CFG
# Written by compose/local/secure.sh; edits are overwritten on the next start.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$KAFKA_HOST:$SECURE_CONTROLLER_PORT
listeners=SASL_SSL://$KAFKA_HOST:$SECURE_KAFKA_PORT,INTERNAL://$KAFKA_HOST:$SECURE_INTERNAL_PORT,CONTROLLER://$KAFKA_HOST:$SECURE_CONTROLLER_PORT
advertised.listeners=SASL_SSL://$KAFKA_HOST:$SECURE_KAFKA_PORT,INTERNAL://$KAFKA_HOST:$SECURE_INTERNAL_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
listener.security.protocol.map=SASL_SSL:SASL_SSL,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS/server.p12
ssl.keystore.password=conveyor-keystore
ssl.key.password=conveyor-keystore
log.dirs=$DIR/kafka/data
$(kafka_single_node_config)
offsets.topic.num.partitions=3
$(authorizer_config)
CFG
}

# With SECURE_ACLS=1: every request authorized, nothing allowed without an ACL. The
# loopback PLAINTEXT listeners authenticate no one; their principal, ANONYMOUS, is the
# node talking to itself (and an administrator on this host), so it is a super user.
authorizer_config() {
  [ "$SECURE_ACLS" = 1 ] || return 0
  cat <<CFG
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:$SECURE_USER;User:ANONYMOUS
allow.everyone.if.no.acl.found=false
CFG
}

start_kafka() {
  if pid_alive "$KAFKA_PIDFILE" "$KAFKA_PATTERN"; then
    log "secured Kafka already running (pid $(cat "$KAFKA_PIDFILE")) on $KAFKA_HOST:$SECURE_KAFKA_PORT"
    return 0
  fi
  for port in "$SECURE_KAFKA_PORT" "$SECURE_CONTROLLER_PORT" "$SECURE_INTERNAL_PORT"; do
    port_in_use "$port" && die "cannot start secured Kafka: port $port on 127.0.0.1 is in use. Choose others with SECURE_KAFKA_PORT=<port> (it uses the next two as well)"
  done
  "$ROOT/compose/local/fetch-kafka.sh"
  write_kafka_config
  if [ ! -f "$DIR/kafka/data/meta.properties" ]; then
    # SCRAM credentials are stored in the cluster metadata written here, so the
    # user exists before the broker accepts its first connection.
    local cluster_id
    cluster_id=$(kafka_random_id)
    local users=(--add-scram "SCRAM-SHA-512=[name=$SECURE_USER,password=$SECURE_PASSWORD]")
    if [ "$SECURE_ACLS" = 1 ]; then
      users+=(--add-scram "SCRAM-SHA-512=[name=$SECURE_LIMITED_USER,password=$SECURE_PASSWORD]")
    fi
    kafka_format "$KAFKA_CONFIG" "$cluster_id" "$DIR/kafka/logs" "${users[@]}"
  fi
  log "starting secured Kafka (SASL_SSL, SCRAM-SHA-512$ACL_NOTE) on $KAFKA_HOST:$SECURE_KAFKA_PORT (log: $KAFKA_LOG)"
  kafka_launch "$KAFKA_CONFIG" "$DIR/kafka/logs" "$KAFKA_PIDFILE" "$KAFKA_HEAP"
  # Ready once the broker answers on its loopback listener; all listeners open together.
  if ! python3 "$ROOT/compose/local/ready.py" kafka "$KAFKA_HOST" "$SECURE_INTERNAL_PORT" --timeout "$READY_TIMEOUT" --pid "$(cat "$KAFKA_PIDFILE")"; then
    cat "$DIR/kafka/logs/stdout.log" >>"$KAFKA_LOG" 2>/dev/null || true
    stop_pid "$KAFKA_PIDFILE" "$KAFKA_PATTERN" "secured Kafka"
    fail_start "secured Kafka" "$SECURE_KAFKA_PORT" "$KAFKA_LOG" SECURE_KAFKA_PORT
  fi
  log "secured Kafka ready on $KAFKA_HOST:$SECURE_KAFKA_PORT"
}

start_redis() {
  if pid_alive "$REDIS_PIDFILE" "$REDIS_PATTERN"; then
    log "secured Redis already running (pid $(cat "$REDIS_PIDFILE")) on $REDIS_HOST:$SECURE_REDIS_PORT"
    return 0
  fi
  port_in_use "$SECURE_REDIS_PORT" && die "cannot start secured Redis: port $SECURE_REDIS_PORT on 127.0.0.1 is in use. Choose another with SECURE_REDIS_PORT=<port>"
  apt_install redis-server redis-server
  mkdir -p "$DIR/redis"
  log "starting secured Redis (TLS, ACL user $SECURE_USER) on $REDIS_HOST:$SECURE_REDIS_PORT (log: $REDIS_LOG)"
  # The configuration comes on stdin, not the command line, so the password does
  # not show in the process list. Clients need no certificate of their own.
  nohup redis-server - >/dev/null 2>&1 <<CFG &
bind $REDIS_HOST
port 0
tls-port $SECURE_REDIS_PORT
tls-cert-file $TLS/server.pem
tls-key-file $TLS/server.key
tls-ca-cert-file $TLS/ca.pem
tls-auth-clients optional
dir $DIR/redis
save ""
appendonly no
logfile $REDIS_LOG
daemonize no
user default off
user $SECURE_USER on >$SECURE_PASSWORD ~* &* +@all
CFG
  echo $! >"$REDIS_PIDFILE"
  local deadline=$((SECONDS + READY_TIMEOUT))
  until REDISCLI_AUTH="$SECURE_PASSWORD" redis-cli --tls --cacert "$TLS/ca.pem" -h "$REDIS_HOST" \
      -p "$SECURE_REDIS_PORT" --user "$SECURE_USER" ping 2>/dev/null | grep -q PONG; do
    if ! running "$(cat "$REDIS_PIDFILE")" || [ "$SECONDS" -ge "$deadline" ]; then
      stop_pid "$REDIS_PIDFILE" "$REDIS_PATTERN" "secured Redis"
      fail_start "secured Redis" "$SECURE_REDIS_PORT" "$REDIS_LOG" SECURE_REDIS_PORT
    fi
    sleep 0.2  # poll interval between real PINGs, not a wait for readiness
  done
  log "secured Redis ready on $REDIS_HOST:$SECURE_REDIS_PORT"
}

start() {
  [ -n "${SECURE_PASSWORD:-}" ] || die "set SECURE_PASSWORD: the password of user $SECURE_USER on both services"
  make_certificates
  start_redis
  start_kafka
  log "connect with: CONVEYOR_KAFKA_BOOTSTRAP=$KAFKA_HOST:$SECURE_KAFKA_PORT" \
    "CONVEYOR_KAFKA_SECURITY_PROTOCOL=SASL_SSL CONVEYOR_KAFKA_SASL_MECHANISM=SCRAM-SHA-512" \
    "CONVEYOR_KAFKA_USERNAME=$SECURE_USER CONVEYOR_KAFKA_PASSWORD=... CONVEYOR_KAFKA_CA_FILE=$TLS/ca.pem" \
    "CONVEYOR_REDIS_URL=rediss://$REDIS_HOST:$SECURE_REDIS_PORT/0 CONVEYOR_REDIS_USERNAME=$SECURE_USER" \
    "CONVEYOR_REDIS_PASSWORD=... CONVEYOR_REDIS_CA_FILE=$TLS/ca.pem"
}

stop() {
  stop_pid "$KAFKA_PIDFILE" "$KAFKA_PATTERN" "secured Kafka"
  stop_pid "$REDIS_PIDFILE" "$REDIS_PATTERN" "secured Redis"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status)
    pid_alive "$KAFKA_PIDFILE" "$KAFKA_PATTERN" && echo "secured kafka running pid $(cat "$KAFKA_PIDFILE")" || echo "secured kafka stopped"
    pid_alive "$REDIS_PIDFILE" "$REDIS_PATTERN" && echo "secured redis running pid $(cat "$REDIS_PIDFILE")" || echo "secured redis stopped"
    ;;
  *) die "usage: SECURE_PASSWORD=... secure.sh start|stop|status" ;;
esac
