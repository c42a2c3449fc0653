#!/usr/bin/env bash
# Replicated services for dedupe-worker's cluster tests, beside (never instead of) the single
# nodes of scripts/services.sh, all on 127.0.0.1:
#
#   scripts/cluster.sh [up|down|status|reset] [postgres] [rabbitmq] [kafka]
#   scripts/cluster.sh pg-sync on|off        the standby synchronous (default) or asynchronous
#   scripts/cluster.sh pg-failover [LAG_S]   kill -9 every process of the primary, promote the
#                                            standby (the next `up postgres` rebuilds the pair);
#                                            LAG_S: the primary's WAL sender frozen that long
#                                            first (what it held back is lost unless synchronous)
#   scripts/cluster.sh kafka-kill-leader TOPIC [PARTITION]
#                                            kill -9 the broker leading PARTITION of TOPIC (default:
#                                            the one leading most of its partitions) and wait until
#                                            they have new leaders; `up kafka` starts it again and
#                                            waits until every partition's replicas are in sync
#   scripts/cluster.sh rabbitmq-kill-leader QUEUE
#                                            kill -9 the Erlang VM of the node leading the quorum
#                                            queue QUEUE and wait until another node leads it;
#                                            `up rabbitmq` starts the node again, back in the cluster
#
#   PostgreSQL  primary  postgresql://dedupe:dedupe@127.0.0.1:5442/dedupe   (cluster 15/dedupe_primary)
#               standby  127.0.0.1:5443, streaming from the primary         (cluster 15/dedupe_standby)
#               both:    postgresql://dedupe:dedupe@127.0.0.1:5442,127.0.0.1:5443/dedupe?target_session_attrs=read-write
#   RabbitMQ    amqp://guest:guest@127.0.0.1:5681/ (and :5682, :5683): nodes dedupe-c1..3@localhost
#   Kafka       127.0.0.1:19092,127.0.0.1:19192,127.0.0.1:19292 (KRaft, node ids 1..3, each a
#               controller too; RF 3, min.insync.replicas=2)
#
# `up` is idempotent: it starts what is not running and rebuilds what is not in the expected
# shape (a standby that was promoted by a failover test, a RabbitMQ node that left the cluster):
# these are throwaway test services, never data to keep. `reset` rebuilds from scratch. Every
# wait is bounded. The packages and the Kafka jars come from scripts/services.sh.
#
# Environment:
#   DEDUPE_SERVICES_DIR   run-time state (Kafka configs, data, logs, pids)  default <repo>/.services
#   DEDUPE_CACHE_DIR      downloaded Kafka jars                             default <repo>/.cache
#   DEDUPE_CLUSTER_HEAP   each Kafka broker's JVM heap options              default -Xmx384m
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERVICES="$ROOT/scripts/services.sh"
SERVICES_DIR="${DEDUPE_SERVICES_DIR:-$ROOT/.services}"
CACHE_DIR="${DEDUPE_CACHE_DIR:-$ROOT/.cache}"
STATE="$SERVICES_DIR/cluster"

PG_VERSION=15
PG_PRIMARY=dedupe_primary
PG_STANDBY=dedupe_standby
PG_PRIMARY_PORT=5442
PG_STANDBY_PORT=5443

RABBIT_NODES=(dedupe-c1 dedupe-c2 dedupe-c3)
RABBIT_PORTS=(5681 5682 5683)
RABBIT_DIST_PORTS=(25681 25682 25683)
RABBIT_BASE=/var/lib/rabbitmq/dedupe-cluster
RABBIT_LOGS=/var/log/rabbitmq/dedupe-cluster

KAFKA_LIBS="$CACHE_DIR/kafka/libs"
KAFKA_LOG4J="$ROOT/scripts/kafka/log4j2.properties"
KAFKA_POM="$ROOT/scripts/kafka/pom.xml"
KAFKA_PORTS=(19092 19192 19292)
KAFKA_CONTROLLER_PORTS=(19093 19193 19293)
KAFKA_HEAP="${DEDUPE_CLUSTER_HEAP:--Xmx384m}"
KAFKA_BOOTSTRAP="127.0.0.1:19092,127.0.0.1:19192,127.0.0.1:19292"

START_TIMEOUT=120
STOP_TIMEOUT=30

export HOME="${HOME:-/root}"
export LC_ALL="${LC_ALL:-C.UTF-8}"

log() { printf 'cluster: %s\n' "$*"; }
die() { printf 'cluster: error: %s\n' "$*" >&2; exit 1; }
now() { date +%s; }
kill9() {  # kill9 <pid> <what>: kill -9 the process and wait (30 s at most) until it is gone
  local pid=$1 what=$2 deadline
  kill -9 "$pid" 2>/dev/null || true
  deadline=$(( $(now) + 30 ))
  while kill -0 "$pid" 2>/dev/null; do
    [ "$(now)" -lt "$deadline" ] || die "$what (pid $pid) did not die within 30 s"
    sleep 0.1
  done
}
# without_extra_fds and port_open.
# shellcheck source=scripts/lib/process.sh
. "$ROOT/scripts/lib/process.sh"

usage() {
  sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# ----------------------------------------------------------------------------------------------
# PostgreSQL: a primary and a streaming standby
# ----------------------------------------------------------------------------------------------
pg_su() { (cd / && timeout 60 runuser -u postgres -- "$@"); }
pg_sql() {  # pg_sql <port> <sql>: one value, as the superuser over the socket
  pg_su psql -X -q -At -v ON_ERROR_STOP=1 -p "$1" -d postgres -c "$2"
}
pg_exists() { pg_lsclusters -h 2>/dev/null | awk '{print $2}' | grep -qx "$1"; }
pg_online() { pg_lsclusters -h 2>/dev/null | awk -v c="$1" '$2 == c && $4 ~ /online/' | grep -q .; }
pg_ctl() {  # pg_ctl <cluster> <start|stop|promote> [options]
  local cluster=$1; shift
  (without_extra_fds timeout "$START_TIMEOUT" pg_ctlcluster --skip-systemctl-redirect \
    "$PG_VERSION" "$cluster" "$@" </dev/null)
}
pg_in_recovery() { [ "$(pg_sql "$PG_STANDBY_PORT" 'SELECT pg_is_in_recovery()' 2>/dev/null)" = t ]; }
pg_streaming() {
  [ "$(pg_sql "$PG_PRIMARY_PORT" \
    "SELECT count(*) FROM pg_stat_replication WHERE application_name = '$PG_STANDBY' AND state = 'streaming'" 2>/dev/null)" = 1 ]
}
pg_healthy() {
  pg_online "$PG_PRIMARY" && pg_online "$PG_STANDBY" \
    && [ "$(pg_sql "$PG_PRIMARY_PORT" 'SELECT pg_is_in_recovery()' 2>/dev/null)" = f ] \
    && pg_in_recovery && pg_streaming
}

pg_drop() {
  local c
  for c in "$PG_STANDBY" "$PG_PRIMARY"; do
    if pg_exists "$c"; then
      log "postgres: dropping cluster $PG_VERSION/$c"
      timeout 60 pg_dropcluster --stop "$PG_VERSION" "$c" >/dev/null 2>&1 \
        || { pg_ctl "$c" stop -m immediate >/dev/null 2>&1 || true; timeout 60 pg_dropcluster "$PG_VERSION" "$c"; }
    fi
  done
}

pg_create_primary() {
  log "postgres: creating the primary $PG_VERSION/$PG_PRIMARY on 127.0.0.1:$PG_PRIMARY_PORT"
  timeout 120 pg_createcluster "$PG_VERSION" "$PG_PRIMARY" --port "$PG_PRIMARY_PORT" \
    -- --auth-local=peer --auth-host=scram-sha-256 >/dev/null
  local conf="/etc/postgresql/$PG_VERSION/$PG_PRIMARY"
  cat >"$conf/conf.d/dedupe-cluster.conf" <<EOF
# Written by scripts/cluster.sh: a primary that streams to $PG_STANDBY.
listen_addresses = '127.0.0.1'
wal_level = replica
max_wal_senders = 5
wal_keep_size = '256MB'
hot_standby = on
synchronous_commit = on
max_connections = 200
EOF
  printf 'host replication dedupe 127.0.0.1/32 scram-sha-256\n' >>"$conf/pg_hba.conf"
  pg_ctl "$PG_PRIMARY" start
  pg_sql "$PG_PRIMARY_PORT" "CREATE ROLE dedupe LOGIN CREATEDB REPLICATION PASSWORD 'dedupe'" >/dev/null
  pg_sql "$PG_PRIMARY_PORT" "CREATE DATABASE dedupe OWNER dedupe" >/dev/null
}

pg_create_standby() {
  log "postgres: creating the standby $PG_VERSION/$PG_STANDBY on 127.0.0.1:$PG_STANDBY_PORT (pg_basebackup)"
  timeout 120 pg_createcluster "$PG_VERSION" "$PG_STANDBY" --port "$PG_STANDBY_PORT" >/dev/null
  local data="/var/lib/postgresql/$PG_VERSION/$PG_STANDBY"
  # The standby's own conf.d and pg_hba stay (Debian keeps them in /etc); its data is the
  # primary's, streamed, with primary_conninfo and standby.signal written by -R.
  cp "/etc/postgresql/$PG_VERSION/$PG_PRIMARY/conf.d/dedupe-cluster.conf" \
    "/etc/postgresql/$PG_VERSION/$PG_STANDBY/conf.d/dedupe-cluster.conf"
  cp "/etc/postgresql/$PG_VERSION/$PG_PRIMARY/pg_hba.conf" "/etc/postgresql/$PG_VERSION/$PG_STANDBY/pg_hba.conf"
  rm -rf "$data"
  (cd / && PGPASSWORD=dedupe timeout 300 runuser -u postgres -- pg_basebackup \
    -d "host=127.0.0.1 port=$PG_PRIMARY_PORT user=dedupe application_name=$PG_STANDBY" \
    -D "$data" -R -X stream -c fast) >/dev/null
  pg_ctl "$PG_STANDBY" start
}

pg_sync() {  # pg_sync on|off
  local names=""
  [ "$1" = on ] && names="$PG_STANDBY"
  pg_sql "$PG_PRIMARY_PORT" "ALTER SYSTEM SET synchronous_standby_names = '$names'" >/dev/null
  pg_sql "$PG_PRIMARY_PORT" "SELECT pg_reload_conf()" >/dev/null
  log "postgres: standby $PG_STANDBY is $([ "$1" = on ] && echo synchronous || echo asynchronous)"
}

pg_up() {
  "$SERVICES" up postgres >/dev/null  # the packages (and the single node the tests use)
  if pg_healthy; then
    pg_sql "$PG_PRIMARY_PORT" "GRANT pg_monitor TO dedupe" >/dev/null
    log "postgres: up (primary :$PG_PRIMARY_PORT, standby :$PG_STANDBY_PORT streaming)"
    return 0
  fi
  # Started but stopped clusters in the right roles just need starting.
  if pg_exists "$PG_PRIMARY" && pg_exists "$PG_STANDBY" \
      && [ -f "/var/lib/postgresql/$PG_VERSION/$PG_STANDBY/standby.signal" ]; then
    pg_online "$PG_PRIMARY" || pg_ctl "$PG_PRIMARY" start || true
    pg_online "$PG_STANDBY" || pg_ctl "$PG_STANDBY" start || true
  fi
  local deadline=$(( $(now) + 20 ))
  until pg_healthy || [ "$(now)" -ge "$deadline" ]; do sleep 1; done
  if ! pg_healthy; then
    # Not the expected pair (never made, or a failover test promoted the standby): rebuild.
    pg_drop
    pg_create_primary
    pg_create_standby
    deadline=$(( $(now) + START_TIMEOUT ))
    until pg_healthy; do
      [ "$(now)" -lt "$deadline" ] || die "the standby is not streaming from the primary within ${START_TIMEOUT}s; see /var/log/postgresql/postgresql-$PG_VERSION-$PG_STANDBY.log"
      sleep 1
    done
  fi
  # The tests read pg_stat_replication as dedupe (who streams, synchronously or not).
  pg_sql "$PG_PRIMARY_PORT" "GRANT pg_monitor TO dedupe" >/dev/null
  pg_sync "${DEDUPE_PG_SYNC:-on}"
  log "postgres: up (primary :$PG_PRIMARY_PORT, standby :$PG_STANDBY_PORT streaming)"
}

pg_down() {
  local c
  for c in "$PG_STANDBY" "$PG_PRIMARY"; do
    if pg_exists "$c" && pg_online "$c"; then pg_ctl "$c" stop -m fast || true; fi
  done
  log "postgres: primary and standby stopped"
}

pg_status() { pg_healthy; }

pg_failover() {  # the primary dies as a machine would (SIGKILL, no shutdown); the standby is promoted
  pg_exists "$PG_PRIMARY" && pg_exists "$PG_STANDBY" || die "no primary and standby to fail over; run: $0 up postgres"
  pg_in_recovery || die "the standby $PG_STANDBY is not in recovery (failed over already?); run: $0 up postgres"
  local data="/var/lib/postgresql/$PG_VERSION/$PG_PRIMARY" pid
  pid="$(head -1 "$data/postmaster.pid" 2>/dev/null || true)"
  [ -n "$pid" ] || die "the primary $PG_PRIMARY is not running"
  local lag="${1:-0}" sender=""
  if [ "$lag" != 0 ]; then
    # A standby that lags: the primary's WAL sender frozen (SIGSTOP; frozen on the standby's
    # side instead, what was sent would wait in its socket and arrive after all), the primary
    # goes on committing (an asynchronous standby does not hold its commits), then it dies.
    sender="$(pgrep -f "$PG_VERSION/$PG_PRIMARY: walsender" | head -1 || true)"
    [ -n "$sender" ] || die "the primary has no WAL sender to freeze"
    kill -STOP "$sender"
    log "postgres: the primary's WAL sender frozen for ${lag}s"
    sleep "$lag"
  fi
  # The postmaster and every backend at once: their titles carry the cluster's name.
  kill -9 "$pid" 2>/dev/null || true
  pkill -9 -f "$PG_VERSION/$PG_PRIMARY" 2>/dev/null || true
  local deadline=$(( $(now) + 30 ))
  while pgrep -f "$PG_VERSION/$PG_PRIMARY" >/dev/null 2>&1; do
    [ "$(now)" -lt "$deadline" ] || die "the primary's processes did not die within 30 s"
    sleep 0.1
  done
  log "postgres: primary $PG_PRIMARY killed (kill -9)"
  pg_ctl "$PG_STANDBY" promote
  deadline=$(( $(now) + 60 ))
  until [ "$(pg_sql "$PG_STANDBY_PORT" 'SELECT pg_is_in_recovery()' 2>/dev/null)" = f ]; do
    [ "$(now)" -lt "$deadline" ] || die "the standby was not promoted within 60 s"
    sleep 0.1
  done
  log "postgres: standby $PG_STANDBY promoted (primary on :$PG_STANDBY_PORT)"
}

# ----------------------------------------------------------------------------------------------
# RabbitMQ: three nodes, one cluster
# ----------------------------------------------------------------------------------------------
rabbit_env() {  # rabbit_env <i>: the environment of node i, for rabbitmq-server and rabbitmqctl
  local i=$1 n=${RABBIT_NODES[$1]}
  printf '%s ' \
    "RABBITMQ_NODENAME=$n@localhost" \
    "RABBITMQ_NODE_IP_ADDRESS=127.0.0.1" \
    "RABBITMQ_NODE_PORT=${RABBIT_PORTS[$i]}" \
    "RABBITMQ_DIST_PORT=${RABBIT_DIST_PORTS[$i]}" \
    "RABBITMQ_MNESIA_BASE=$RABBIT_BASE/$n/mnesia" \
    "RABBITMQ_LOG_BASE=$RABBIT_LOGS/$n" \
    "RABBITMQ_PID_FILE=$RABBIT_BASE/$n/pid" \
    "RABBITMQ_ENABLED_PLUGINS_FILE=$RABBIT_BASE/$n/enabled_plugins" \
    "RABBITMQ_CONFIG_FILE=$RABBIT_BASE/$n/rabbitmq" \
    "RABBITMQ_ADVANCED_CONFIG_FILE=$RABBIT_BASE/$n/advanced.config"
}
rabbit_as() {  # rabbit_as <i> <timeout> <command...>: as the rabbitmq user, in node i's environment
  local i=$1 t=$2; shift 2
  local env; env="$(rabbit_env "$i")"
  (cd / && without_extra_fds timeout -k 5 "$t" su rabbitmq -s /bin/sh -c \
    "ulimit -n 65536 2>/dev/null || ulimit -n \$(ulimit -Hn); cd /var/lib/rabbitmq && env $env $*")
}
rabbitctl() {  # rabbitctl <i> args...
  local i=$1; shift
  rabbit_as "$i" 60 /usr/lib/rabbitmq/bin/rabbitmqctl -n "${RABBIT_NODES[$i]}@localhost" -q "$@"
}
rabbit_ping() { rabbit_as "$1" 20 /usr/lib/rabbitmq/bin/rabbitmq-diagnostics -n "${RABBIT_NODES[$1]}@localhost" -q ping -t 10 >/dev/null 2>&1; }
rabbit_members() {  # how many nodes node 1 sees running in its cluster
  rabbitctl 0 cluster_status --formatter json 2>/dev/null \
    | python3 -c 'import json, sys; print(len(json.load(sys.stdin).get("running_nodes", [])))' 2>/dev/null \
    || echo 0
}
rabbit_healthy() {
  local i
  for i in 0 1 2; do port_open "${RABBIT_PORTS[$i]}" || return 1; done
  [ "$(rabbit_members)" = 3 ]
}

rabbit_start() {  # rabbit_start <i>: configure node i and start its VM detached (rabbit_booted waits for it)
  local i=$1 n=${RABBIT_NODES[$1]}
  mkdir -p "$RABBIT_BASE/$n/mnesia" "$RABBIT_LOGS/$n"
  [ -f "$RABBIT_BASE/$n/enabled_plugins" ] || printf '[].\n' >"$RABBIT_BASE/$n/enabled_plugins"
  # loopback_users: guest may log in from 127.0.0.1 (the default); quorum queues need nothing.
  printf 'listeners.tcp.default = 127.0.0.1:%s\nloopback_users.guest = true\n' "${RABBIT_PORTS[$i]}" \
    >"$RABBIT_BASE/$n/rabbitmq.conf"
  # A quorum queue dead-letters at least once (the delay queues back to the work queue): its
  # leader's dead-letter worker sends an expired message again only after this long without the
  # target's confirm (RabbitMQ's default: 180 s). When the target's leader is killed mid-send the
  # confirm never comes; 5 s keeps such a message from waiting out a test's drain.
  printf '[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}].\n' \
    >"$RABBIT_BASE/$n/advanced.config"
  chown -R rabbitmq:rabbitmq "$RABBIT_BASE" "$RABBIT_LOGS"
  log "rabbitmq: starting $n@localhost on 127.0.0.1:${RABBIT_PORTS[$i]}"
  rabbit_as "$i" 30 /usr/lib/rabbitmq/bin/rabbitmq-server -detached >"$STATE/$n.start.out" 2>&1 </dev/null \
    || { cat "$STATE/$n.start.out" >&2; die "rabbitmq-server -detached failed for $n"; }
}

rabbit_booted() {  # rabbit_booted <i>: wait, bounded, until node i's VM answers and RabbitMQ has booted
  local i=$1 n=${RABBIT_NODES[$1]}
  local deadline=$(( $(now) + START_TIMEOUT ))
  until rabbit_ping "$i"; do
    [ "$(now)" -lt "$deadline" ] || die "$n did not come up within ${START_TIMEOUT}s; see $RABBIT_LOGS/$n"
    sleep 1
  done
  rabbit_as "$i" $(( START_TIMEOUT + 10 )) /usr/lib/rabbitmq/bin/rabbitmqctl -n "$n@localhost" -q \
    await_startup --timeout "$START_TIMEOUT" </dev/null >/dev/null \
    || die "$n did not finish booting within ${START_TIMEOUT}s; see $RABBIT_LOGS/$n"
}

rabbit_stop() {  # rabbit_stop <i>
  local i=$1
  if rabbit_ping "$i"; then
    rabbitctl "$i" shutdown >/dev/null 2>&1 || true
  fi
}

rabbit_wipe() {
  local i
  for i in 0 1 2; do rabbit_stop "$i"; done
  # A node killed by a test leaves its beam process behind only if it was stopped, not killed;
  # anything still listening on our ports is ours (RABBITMQ_NODENAME is unique to this script).
  pkill -9 -f 'dedupe-c[123]@localhost' 2>/dev/null || true
  rm -rf "$RABBIT_BASE" "$RABBIT_LOGS"
}

rabbit_up() {
  "$SERVICES" up rabbitmq >/dev/null  # the packages, the cookie (and the single node)
  mkdir -p "$STATE"
  if rabbit_healthy; then
    log "rabbitmq: up (3 nodes, 127.0.0.1:5681,5682,5683)"
    return 0
  fi
  # Every stopped node is started before any is waited for: a node that was in the cluster boots
  # only once it has seen the peers it stopped after (RabbitMQ waits for its tables, up to five
  # minutes), so starting one and awaiting it before the next deadlocks until that wait runs out.
  local i started=()
  for i in 0 1 2; do rabbit_ping "$i" || { rabbit_start "$i"; started+=("$i"); }; done
  for i in "${started[@]}"; do rabbit_booted "$i"; done
  local deadline=$(( $(now) + 30 ))
  until rabbit_healthy || [ "$(now)" -ge "$deadline" ]; do sleep 1; done
  if ! rabbit_healthy; then
    log "rabbitmq: the nodes are not one cluster; joining dedupe-c2 and dedupe-c3 to dedupe-c1"
    for i in 1 2; do
      rabbitctl "$i" stop_app >/dev/null
      rabbitctl "$i" reset >/dev/null
      rabbitctl "$i" join_cluster "${RABBIT_NODES[0]}@localhost" >/dev/null
      rabbitctl "$i" start_app >/dev/null
    done
    deadline=$(( $(now) + START_TIMEOUT ))
    until rabbit_healthy; do
      [ "$(now)" -lt "$deadline" ] || die "the three RabbitMQ nodes did not form a cluster within ${START_TIMEOUT}s; see $RABBIT_LOGS"
      sleep 1
    done
  fi
  log "rabbitmq: up (3 nodes, 127.0.0.1:5681,5682,5683)"
}

rabbit_down() {
  local i
  for i in 2 1 0; do rabbit_stop "$i"; done
  log "rabbitmq: cluster nodes stopped"
}

rabbit_status() { rabbit_healthy; }

rabbit_leader() {  # rabbit_leader <queue>: the node leading the quorum queue, asked of a live node
  local i out
  for i in 0 1 2; do
    port_open "${RABBIT_PORTS[$i]}" || continue
    out="$(rabbitctl "$i" list_queues --no-table-headers name type leader 2>/dev/null)" || continue
    awk -F'\t' -v q="$1" '$1 == q && $2 == "quorum" && $3 != "" {print $3; found = 1} END {exit !found}' \
      <<<"$out" && return 0
  done
  return 1
}

rabbit_kill_leader() {  # rabbit_kill_leader <queue>: kill -9 the VM of the node leading it
  local queue=$1 leader i=-1 j pid
  [ -n "$queue" ] || die "rabbitmq-kill-leader takes the name of a quorum queue"
  leader="$(rabbit_leader "$queue")" || die "rabbitmq: no quorum queue '$queue' with a leader on a running node"
  for j in 0 1 2; do [ "$leader" = "${RABBIT_NODES[$j]}@localhost" ] && i=$j; done
  [ "$i" -ge 0 ] || die "rabbitmq: '$queue' is led by $leader, not a node of this script"
  # The node's Erlang VM (beam.smp), from its pid file, checked against the node name in its
  # environment (the VM's command line does not carry it).
  pid="$(cat "$RABBIT_BASE/${RABBIT_NODES[$i]}/pid" 2>/dev/null || true)"
  [[ "$pid" =~ ^[0-9]+$ ]] && tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RABBITMQ_NODENAME=$leader" \
    || die "rabbitmq: no running Erlang VM of $leader (pid file $RABBIT_BASE/${RABBIT_NODES[$i]}/pid)"
  kill9 "$pid" "rabbitmq: $leader"
  log "rabbitmq: $leader killed (kill -9 of its Erlang VM, pid $pid), the leader of $queue"
  # Until the queue's other members have elected a leader among themselves.
  local deadline=$(( $(now) + 60 ))
  local now_leader=""
  until now_leader="$(rabbit_leader "$queue")" && [ "$now_leader" != "$leader" ]; do
    [ "$(now)" -lt "$deadline" ] || die "rabbitmq: $queue had no new leader within 60 s"
    sleep 0.5
  done
  log "rabbitmq: $queue is led by $now_leader now; \`$0 up rabbitmq\` starts $leader again"
}

# ----------------------------------------------------------------------------------------------
# Kafka: three KRaft nodes, each a broker and a controller
# ----------------------------------------------------------------------------------------------
java_bin() { if [ -n "${JAVA_HOME:-}" ]; then echo "$JAVA_HOME/bin/java"; else command -v java; fi; }
kafka_dir() { echo "$STATE/kafka-$1"; }  # node ids 1..3
kafka_tool() {  # kafka_tool <timeout> <class> args...
  local t=$1; shift
  # A client's short run: the JIT's first tier and the serial collector start it faster.
  timeout "$t" "$(java_bin)" -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Dlog4j2.configurationFile="$KAFKA_LOG4J" -cp "$KAFKA_LIBS/*" "$@"
}
kafka_pid() {  # kafka_pid <id>: the broker's pid, if it runs
  local f; f="$(kafka_dir "$1")/kafka.pid"
  [ -f "$f" ] || return 1
  local pid; pid="$(cat "$f")"
  kill -0 "$pid" 2>/dev/null && grep -q "kafka-$1/server.properties" "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}
kafka_healthy() {
  local id
  for id in 1 2 3; do kafka_pid "$id" >/dev/null || return 1; done
  # Every broker listening: a quorum of two answers the check below while the third node is
  # still starting, and a client bootstrapping from that node is refused.
  for id in 0 1 2; do port_open "${KAFKA_PORTS[$id]}" || return 1; done
  # Every broker registered and unfenced: the metadata quorum lists three voters with a leader.
  local out
  out="$(kafka_tool 40 org.apache.kafka.tools.MetadataQuorumCommand \
    --bootstrap-server "$KAFKA_BOOTSTRAP" describe --status 2>/dev/null)" || return 1
  grep -q 'LeaderId:' <<<"$out" && grep -Eq 'CurrentVoters:.*"id": ?3' <<<"$out" \
    || grep -Eq 'CurrentVoters:.*3' <<<"$out"
}

kafka_write_config() {  # kafka_write_config <id>
  local id=$1 i=$(( $1 - 1 )) dir; dir="$(kafka_dir "$1")"
  mkdir -p "$dir/data"
  cat >"$dir/server.properties" <<EOF
# Written by scripts/cluster.sh: KRaft node $id of 3 (broker and controller).
process.roles=broker,controller
node.id=$id
controller.quorum.voters=1@127.0.0.1:${KAFKA_CONTROLLER_PORTS[0]},2@127.0.0.1:${KAFKA_CONTROLLER_PORTS[1]},3@127.0.0.1:${KAFKA_CONTROLLER_PORTS[2]}
listeners=PLAINTEXT://127.0.0.1:${KAFKA_PORTS[$i]},CONTROLLER://127.0.0.1:${KAFKA_CONTROLLER_PORTS[$i]}
advertised.listeners=PLAINTEXT://127.0.0.1:${KAFKA_PORTS[$i]}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$dir/data
num.partitions=4
default.replication.factor=3
min.insync.replicas=2
auto.create.topics.enable=true
unclean.leader.election.enable=false
offsets.topic.replication.factor=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=2
EOF
}

kafka_start() {  # kafka_start <id>
  local id=$1 dir; dir="$(kafka_dir "$1")"
  log "kafka: starting node $id (127.0.0.1:${KAFKA_PORTS[$(( id - 1 ))]}; log $dir/kafka.log)"
  # shellcheck disable=SC2086  # KAFKA_HEAP may hold several JVM options
  (without_extra_fds nohup setsid "$(java_bin)" $KAFKA_HEAP -Xms128m -XX:+UseG1GC \
    -Djava.awt.headless=true -Dlog4j2.configurationFile="$KAFKA_LOG4J" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$dir/server.properties") >>"$dir/kafka.log" 2>&1 </dev/null &
  echo $! >"$dir/kafka.pid"
}

kafka_stop() {  # kafka_stop <id>
  local id=$1 pid
  pid="$(kafka_pid "$id")" || return 0
  kill "$pid" 2>/dev/null || true
  local deadline=$(( $(now) + STOP_TIMEOUT ))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(now)" -ge "$deadline" ]; then kill -9 "$pid" 2>/dev/null || true; sleep 0.5; break; fi
    sleep 0.2
  done
  rm -f "$(kafka_dir "$id")/kafka.pid"
}

kafka_up() {
  [ -d "$KAFKA_LIBS" ] && ls "$KAFKA_LIBS"/kafka_2.13-*.jar >/dev/null 2>&1 \
    || "$SERVICES" up kafka >/dev/null  # fetches the jars (and starts the single node)
  mkdir -p "$STATE"
  if kafka_healthy; then
    kafka_await_in_sync
    log "kafka: up (3 nodes, $KAFKA_BOOTSTRAP)"
    return 0
  fi
  local id cid=""
  for id in 1 2 3; do
    [ -f "$(kafka_dir "$id")/data/meta.properties" ] || { cid=new; break; }
  done
  if [ "$cid" = new ]; then
    for id in 1 2 3; do kafka_stop "$id"; rm -rf "$(kafka_dir "$id")"; done
    cid="$(kafka_tool 60 kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)"
    [[ "$cid" =~ ^[A-Za-z0-9_-]{22}$ ]] || die "kafka: could not generate a cluster id (got '$cid')"
    for id in 1 2 3; do
      kafka_write_config "$id"
      log "kafka: formatting node $id (cluster id $cid)"
      kafka_tool 60 kafka.tools.StorageTool format -t "$cid" -c "$(kafka_dir "$id")/server.properties" \
        >"$(kafka_dir "$id")/format.log" 2>&1 \
        || { tail -n 20 "$(kafka_dir "$id")/format.log" >&2; die "kafka: formatting node $id failed"; }
    done
  fi
  for id in 1 2 3; do
    if ! kafka_pid "$id" >/dev/null; then
      port_open "${KAFKA_PORTS[$(( id - 1 ))]}" \
        && die "127.0.0.1:${KAFKA_PORTS[$(( id - 1 ))]} is taken by a process that is not this script's broker"
      kafka_write_config "$id"
      kafka_start "$id"
    fi
  done
  local deadline=$(( $(now) + START_TIMEOUT ))
  until kafka_healthy; do
    [ "$(now)" -lt "$deadline" ] || die "the Kafka cluster did not form within ${START_TIMEOUT}s; see $STATE/kafka-*/kafka.log"
    sleep 2
  done
  kafka_await_in_sync
  log "kafka: up (3 nodes, $KAFKA_BOOTSTRAP)"
}

kafka_down() {
  local id
  for id in 3 2 1; do kafka_stop "$id"; done
  log "kafka: cluster nodes stopped"
}

kafka_status() { kafka_healthy; }

kafka_partitions() {  # kafka_partitions <topic>: "partition leader replicas isr", one a line
  kafka_tool 60 org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_BOOTSTRAP" \
    --describe --topic "$1" 2>/dev/null \
    | awk '$1 == "Topic:" && $3 == "Partition:" {
        for (i = 5; i < NF; i++) {
          if ($i == "Leader:") l = $(i + 1); if ($i == "Replicas:") r = $(i + 1); if ($i == "Isr:") s = $(i + 1)
        }
        print $4, l, r, s
      }'
}

kafka_in_sync() {  # no partition of any topic misses a replica in its ISR
  local out
  out="$(kafka_tool 60 org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_BOOTSTRAP" \
    --describe --under-replicated-partitions 2>/dev/null)" || return 1
  ! grep -q 'Partition:' <<<"$out"
}
kafka_await_in_sync() {
  # A broker started again (after a kill) catches up before it is back in its partitions'
  # ISRs; until then one more lost broker leaves some partitions below min.insync.replicas.
  local deadline=$(( $(now) + START_TIMEOUT ))
  until kafka_in_sync; do
    [ "$(now)" -lt "$deadline" ] || die "kafka: partitions still under-replicated after ${START_TIMEOUT}s; see $STATE/kafka-*/kafka.log"
    sleep 1
  done
}

kafka_kill_leader() {  # kafka_kill_leader <topic> [partition]: kill -9 the broker leading it
  local topic=$1 partition=${2:-} parts leader led pid
  [ -n "$topic" ] || die "kafka-kill-leader takes a topic (and a partition, optionally)"
  parts="$(kafka_partitions "$topic")" || true
  [ -n "$parts" ] || die "kafka: no partitions of topic '$topic' (no such topic, or the cluster is down)"
  if [ -n "$partition" ]; then
    leader="$(awk -v p="$partition" '$1 == p {print $2}' <<<"$parts")"
  else  # the broker leading most of the topic's partitions (of a tie, the lowest partition's)
    leader="$(awk '$2 ~ /^[0-9]+$/ {n[$2]++; if (!($2 in first)) first[$2] = $1}
      END {for (b in n) print n[b], first[b], b}' <<<"$parts" | sort -k1,1nr -k2,2n | awk 'NR == 1 {print $3}')"
  fi
  [[ "$leader" =~ ^[123]$ ]] || die "kafka: no live leader of $topic${partition:+ partition $partition} (got '$leader')"
  led="$(awk -v b="$leader" '$2 == b {printf "%s%s", sep, $1; sep = ","}' <<<"$parts")"
  pid="$(kafka_pid "$leader")" || die "kafka: node $leader leads $topic but does not run as this script's broker"
  kill9 "$pid" "kafka: node $leader"
  rm -f "$(kafka_dir "$leader")/kafka.pid"
  log "kafka: node $leader killed (kill -9), the leader of $topic partition(s) $led"
  # Until the controller has fenced it (broker.session.timeout.ms) and moved its partitions.
  local deadline=$(( $(now) + 60 ))
  until parts="$(kafka_partitions "$topic")" && [ -n "$parts" ] \
      && awk -v b="$leader" -v led=",$led," \
        'index(led, "," $1 ",") && ($2 == b || $2 !~ /^[0-9]+$/) {bad = 1} END {exit bad}' <<<"$parts"; do
    [ "$(now)" -lt "$deadline" ] || die "kafka: partition(s) $led of $topic had no new leader within 60 s"
    sleep 1
  done
  log "kafka: $topic is led by $(awk '{printf "%s%s:%s", sep, $1, $2; sep = " "}' <<<"$parts") (partition:node) now; \`$0 up kafka\` starts node $leader again"
}

# ----------------------------------------------------------------------------------------------
cmd="${1:-up}"
[ $# -gt 0 ] && shift
case "$cmd" in
  -h | --help | help) usage; exit 0 ;;
  pg-sync)
    case "${1:-}" in on | off) pg_sync "$1"; exit 0 ;; *) die "pg-sync takes on or off" ;; esac ;;
  pg-failover) pg_failover "${1:-0}"; exit 0 ;;
  kafka-kill-leader) mkdir -p "$STATE"; kafka_kill_leader "${1:-}" "${2:-}"; exit 0 ;;
  rabbitmq-kill-leader) rabbit_kill_leader "${1:-}"; exit 0 ;;
  up | down | status | reset) ;;
  *) usage >&2; die "unknown command '$cmd'" ;;
esac
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(postgres rabbitmq kafka)
mkdir -p "$STATE"
rc=0
for s in "${names[@]}"; do
  case "$s" in postgres | pg) f=pg ;; rabbitmq | rabbit) f=rabbit ;; kafka) f=kafka ;; *) die "unknown service '$s'" ;; esac
  case "$cmd" in
    up) "${f}_up" ;;
    down) "${f}_down" ;;
    reset)
      case "$f" in
        pg) pg_drop ;;
        rabbit) rabbit_wipe ;;
        kafka) kafka_down; rm -rf "$STATE"/kafka-* ;;
      esac
      "${f}_up" ;;
    status)
      if "${f}_status"; then log "$s: up"; else log "$s: down"; rc=1; fi ;;
  esac
done
exit "$rc"
