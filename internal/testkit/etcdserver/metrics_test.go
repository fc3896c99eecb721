package etcdserver

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestMetrics(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, `# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 0.08

grpc_server_msg_received_total{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 12
grpc_server_msg_received_total{grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 3
etcd_server_proposals_committed_total 1.5e+06
`)
	}))
	defer srv.Close()
	got, err := Metrics(context.Background(), nil, srv.URL+"/")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{
		"process_cpu_seconds_total": 0.08,
		`grpc_server_msg_received_total{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"}`: 12,
		`grpc_server_msg_received_total{grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"}`:                     3,
		"etcd_server_proposals_committed_total": 1.5e6,
	}
	if len(got) != len(want) {
		t.Fatalf("got %d series, want %d: %v", len(got), len(want), got)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if n := MetricName(`grpc_server_msg_received_total{grpc_method="Txn"}`); n != "grpc_server_msg_received_total" {
		t.Errorf("MetricName = %q", n)
	}
	if _, err := Metrics(context.Background(), nil, srv.URL+"/nothing"); err == nil {
		t.Error("a 404 read as metrics")
	}
}
