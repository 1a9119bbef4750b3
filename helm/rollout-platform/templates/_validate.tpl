{{/*
Cross-field rules JSON Schema cannot express; values.schema.json handles the rest
(types, ranges, unknown keys). Messages name the offending value by its path.
*/}}
{{- define "rollout.validate" -}}
{{- $tp := include "rollout.tp" . | int -}}
{{- $gpus := include "rollout.gpusPerPod" . | int -}}
{{- if include "rollout.cpuOnly" . -}}
  {{- if and (not (kindIs "invalid" .Values.worker.gpusPerPod)) (gt (.Values.worker.gpusPerPod | int) 0) -}}
    {{- fail (printf "worker.gpusPerPod (%d) must be unset or 0 when platform.model.device is cpu" (.Values.worker.gpusPerPod | int)) -}}
  {{- end -}}
{{- else if lt $gpus $tp -}}
  {{- fail (printf "platform.model.tensor_parallel_size (%d) must be <= worker.gpusPerPod (%d): a replica's tensor-parallel workers share one pod" $tp $gpus) -}}
{{- end -}}
{{- $a := (.Values.platform.deployment | default dict).autoscaling -}}
{{- if kindIs "map" $a -}}
  {{- $b := include "rollout.replicaBounds" . | fromJson -}}
  {{- if gt (int $b.min) (int $b.max) -}}
    {{- fail (printf "platform.deployment.autoscaling.min_replicas (%d) must be <= platform.deployment.autoscaling.max_replicas (%d)" (int $b.min) (int $b.max)) -}}
  {{- end -}}
  {{- $look := ternary $a.look_back_period_s 30.0 (hasKey $a "look_back_period_s") | float64 -}}
  {{- range $field, $default := dict "upscale_delay_s" 30.0 "downscale_delay_s" 300.0 -}}
    {{- $v := ternary (get $a $field) $default (hasKey $a $field) | float64 -}}
    {{- if lt $v $look -}}
      {{- fail (printf "platform.deployment.autoscaling.%s (%v) must be >= platform.deployment.autoscaling.look_back_period_s (%v)" $field $v $look) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- if and (not .Values.secrets.create) (not .Values.secrets.existingSecret) -}}
  {{- fail "secrets.existingSecret must name a Secret when secrets.create is false" -}}
{{- end -}}
{{- if and .Values.modelCache.enabled (not .Values.modelCache.existingClaim) (not .Values.modelCache.size) -}}
  {{- fail "modelCache.size must be set when modelCache.existingClaim is empty" -}}
{{- end -}}
{{- end -}}
